"""CPU: plan keys and the LRU plan cache, with fake plans (no GPU, no cuDNN)."""

import dataclasses
import os
import threading
import time

import pytest

from fusekit import config
from fusekit.errors import SettingError
from fusekit.engine import cache as cache_mod
from fusekit.engine.cache import DEFAULT_HEURISTICS, Plan, PlanCache, PlanKey, default_cache
from fusekit.errors import FusekitError


from plankeys import BASE, key  # noqa: E402
from plankeys import specs as _specs  # noqa: E402

# one changed value per field
VARIANTS = {
    "pattern": "conv_bias",
    "digest": "fedcba9876543210",
    "specs": _specs(layout="NCHW"),
    "alignments": (32, 16, 32, 32),
    "attrs": (("padding", (1, 1)), ("stride", (2, 2)), ("dilation", (1, 1))),
    "compute_dtype": "float16",
    "gpu": "NVIDIA A100-SXM4-80GB",
    "cc": (8, 0),
    "cudnn_backend": 90500,
    "frontend": "1.31.0",
    "tf32": True,
}




def plan(k):
    return Plan(k, graph=None, uids=(), workspace_size=0, engine="fake", candidates=1, build_ms=0.0)


def keys(n):
    return [key(pattern=f"p{i}") for i in range(n)]


# ----------------------------------------------------------------------------------------------
# PlanKey
# ----------------------------------------------------------------------------------------------
def test_variants_cover_every_field():
    """A field added to PlanKey must get a variant here (and so a test that it matters)."""
    assert set(VARIANTS) == {f.name for f in dataclasses.fields(PlanKey)}
    assert set(BASE) == set(VARIANTS)


def test_equal_keys_hash_equal():
    a, b = key(), key(specs=_specs(), attrs=tuple(BASE["attrs"]))
    assert a is not b
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1


# ids are prefixed: a bare id "gpu" becomes a keyword, and conftest skips items with the "gpu" keyword
@pytest.mark.parametrize("field", sorted(VARIANTS), ids=lambda f: f"field_{f}")
def test_every_field_matters(field):
    assert VARIANTS[field] != BASE[field]
    a, b = key(), key(**{field: VARIANTS[field]})
    assert a != b
    assert len({a, b}) == 2
    cache = PlanCache(maxsize=4)
    cache.put(plan(a))
    assert b not in cache and cache.get(b) is None
    assert cache.get(a) is not None


@pytest.mark.parametrize(
    "specs",
    [_specs(dtype="bfloat16"), _specs(n=3), tuple(reversed(_specs())), _specs()[:3]],
    ids=["dtype", "batch", "order", "missing_output"],
)
def test_spec_details_matter(specs):
    assert key(specs=specs) != key()


def test_key_is_frozen_and_describes_itself():
    k = key()
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.pattern = "other"  # type: ignore[misc]
    text = k.describe()
    assert "conv_bias_relu" in text and "NVIDIA H200" in text and "sm_90" in text
    assert "x=float16[2, 8, 9, 9]:NHWC" in text and "padding=(1, 1)" in text


def test_default_heuristics():
    fields = {f.name: f for f in dataclasses.fields(PlanKey)}
    assert "heuristics" not in fields  # which heuristics chose a plan does not change its validity
    assert PlanCache(maxsize=1).heuristics == DEFAULT_HEURISTICS
    assert PlanCache(maxsize=1, heuristics=["B"]).heuristics == ("B",)


# ----------------------------------------------------------------------------------------------
# PlanCache
# ----------------------------------------------------------------------------------------------
def test_lru_order_and_eviction():
    k1, k2, k3, k4, k5 = keys(5)
    cache = PlanCache(maxsize=3)
    plans = {k: plan(k) for k in (k1, k2, k3, k4, k5)}
    evicted = []
    cache.on_evict(evicted.append)
    for k in (k1, k2, k3):
        cache.put(plans[k])
    assert list(cache) == [k1, k2, k3] and len(cache) == 3
    assert cache.get(k1) is plans[k1]  # k1 becomes most recently used
    assert list(cache) == [k2, k3, k1]
    cache.put(plans[k4])  # evicts the least recently used: k2
    assert list(cache) == [k3, k1, k4]
    assert k2 not in cache and cache.get(k2) is None
    assert evicted == [plans[k2]] and plans[k2].evicted
    assert not any(plans[k].evicted for k in (k1, k3, k4))
    cache.put(plans[k5])  # then k3
    assert list(cache) == [k1, k4, k5]
    assert evicted == [plans[k2], plans[k3]]
    assert cache.stats.evictions == 2
    assert len(cache) == 3


def test_get_does_not_count_and_missing_is_none():
    cache = PlanCache(maxsize=2)
    k = key()
    assert cache.get(k) is None
    cache.put(plan(k))
    assert cache.get(k) is not None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.builds) == (0, 0, 0)


def test_get_or_build_builds_once():
    cache = PlanCache(maxsize=8)
    k = key()
    calls = []

    def build():
        calls.append(1)
        return plan(k)

    p1 = cache.get_or_build(k, build)
    assert len(calls) == 1
    assert (cache.stats.hits, cache.stats.misses, cache.stats.builds) == (0, 1, 1)
    p2 = cache.get_or_build(k, build)
    p3 = cache.get_or_build(key(), build)  # an equal key built separately
    assert p1 is p2 is p3
    assert len(calls) == 1
    assert (cache.stats.hits, cache.stats.misses, cache.stats.builds) == (2, 1, 1)
    # another key is another build
    k2 = key(cc=(8, 9))
    p4 = cache.get_or_build(k2, lambda: plan(k2))
    assert p4 is not p1 and p4.key == k2
    assert (cache.stats.hits, cache.stats.misses, cache.stats.builds) == (2, 2, 2)
    assert len(cache) == 2


def test_get_or_build_hit_refreshes_lru():
    k1, k2, k3 = keys(3)
    cache = PlanCache(maxsize=2)
    cache.get_or_build(k1, lambda: plan(k1))
    cache.get_or_build(k2, lambda: plan(k2))
    cache.get_or_build(k1, lambda: pytest.fail("k1 is cached"))  # hit: k1 is now most recent
    cache.get_or_build(k3, lambda: plan(k3))
    assert list(cache) == [k1, k3]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.builds, cache.stats.evictions) == (1, 3, 3, 1)


def test_failed_build_caches_nothing():
    cache = PlanCache(maxsize=2)
    k = key()

    def boom():
        raise RuntimeError("no engine")

    with pytest.raises(RuntimeError, match="no engine"):
        cache.get_or_build(k, boom)
    assert k not in cache and len(cache) == 0
    assert cache.stats.builds == 0
    # the next call tries again
    p = cache.get_or_build(k, lambda: plan(k))
    assert cache.get(k) is p and cache.stats.builds == 1


def test_concurrent_get_or_build_builds_once():
    cache = PlanCache(maxsize=4)
    k = key()
    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.02)
        return plan(k)

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_build(k, slow_build))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert cache.stats.builds == 1 and cache.stats.hits == 7


def test_on_evict_callbacks_in_order():
    k1, k2 = keys(2)
    cache = PlanCache(maxsize=1)
    log = []
    cache.on_evict(lambda p: log.append(("first", p.key)))
    cache.on_evict(lambda p: log.append(("second", p.key, p.evicted)))
    p1 = plan(k1)
    cache.put(p1)
    assert log == [] and not p1.evicted
    cache.put(plan(k2))
    assert log == [("first", k1), ("second", k1, True)]  # evicted is set before callbacks run
    assert p1.evicted


def test_clear_evicts_everything():
    ks = keys(3)
    cache = PlanCache(maxsize=5)
    plans = [plan(k) for k in ks]
    for p in plans:
        cache.put(p)
    seen = []
    cache.on_evict(seen.append)
    cache.clear()
    assert len(cache) == 0 and list(cache) == []
    assert all(k not in cache for k in ks)
    assert all(p.evicted for p in plans)
    assert sorted(id(p) for p in seen) == sorted(id(p) for p in plans)
    # still usable afterwards
    cache.put(plan(ks[0]))
    assert ks[0] in cache and len(cache) == 1


def test_put_same_key_keeps_one_entry():
    k = key()
    cache = PlanCache(maxsize=3)
    cache.put(plan(k))
    newer = plan(k)
    cache.put(newer)
    assert len(cache) == 1 and cache.get(k) is newer


def test_maxsize_one():
    k1, k2 = keys(2)
    cache = PlanCache(maxsize=1)
    cache.put(plan(k1))
    cache.put(plan(k2))
    assert list(cache) == [k2]


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_maxsize_below_one_rejected(bad):
    with pytest.raises(ValueError, match=r"maxsize must be >= 1"):
        PlanCache(maxsize=bad)


def test_env_cache_size(monkeypatch):
    monkeypatch.setenv("FUSEKIT_CACHE_SIZE", "2")
    cache = PlanCache()
    assert cache.maxsize == 2
    k1, k2, k3 = keys(3)
    for k in (k1, k2, k3):
        cache.put(plan(k))
    assert list(cache) == [k2, k3]
    # an explicit maxsize wins over the environment
    assert PlanCache(maxsize=7).maxsize == 7
    monkeypatch.setenv("FUSEKIT_CACHE_SIZE", "0")
    with pytest.raises(SettingError, match=r"FUSEKIT_CACHE_SIZE='0' is invalid: expected an integer from 1 to 1,000,000"):
        PlanCache()


def test_default_size_without_env(monkeypatch):
    monkeypatch.delenv("FUSEKIT_CACHE_SIZE", raising=False)
    assert PlanCache().maxsize == 512


def test_an_empty_cache_is_still_used():
    """`cache or default_cache()` must not skip an empty PlanCache (it has __len__)."""
    assert bool(PlanCache(maxsize=1))


# ----------------------------------------------------------------------------------------------
# settings: checked in fusekit.config, one clear error naming the variable, its value and what fits
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch, fresh_session):
    for var in config.SETTINGS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("raw", ["0", "-3", "abc", "1.5", ""])
def test_bad_cache_size_is_a_setting_error(clean_env, raw):
    clean_env.setenv("FUSEKIT_CACHE_DIR", "off")
    clean_env.setenv("FUSEKIT_CACHE_SIZE", raw)
    for make in (PlanCache, default_cache):
        with pytest.raises(SettingError) as e:
            make()
        assert isinstance(e.value, FusekitError)
        assert str(e.value) == f"FUSEKIT_CACHE_SIZE={raw!r} is invalid: expected an integer from 1 to 1,000,000 (plans kept in memory)"
    assert config.problems() == [str(e.value)]


def test_bad_mode_is_a_setting_error(clean_env):
    clean_env.setenv("FUSEKIT_CACHE_DIR", "off")
    clean_env.setenv("FUSEKIT_MODE", "turbo")
    with pytest.raises(SettingError, match=r"^FUSEKIT_MODE='turbo' is invalid: expected one of heuristic, autotune$"):
        default_cache()
    assert PlanCache(mode="autotune").mode == "autotune"  # an explicit mode does not read the variable


@pytest.mark.parametrize("below", [False, True], ids=["file", "below_file"])
def test_cache_dir_naming_a_file_is_a_setting_error(clean_env, tmp_path, below):
    f = tmp_path / "plans.txt"
    f.write_text("not a directory")
    target = f / "sub" / "dir" if below else f
    clean_env.setenv("FUSEKIT_CACHE_DIR", str(target))
    with pytest.raises(SettingError) as e:
        default_cache()
    msg = str(e.value)
    assert msg.startswith(f"FUSEKIT_CACHE_DIR={str(target)!r} is invalid: expected a directory")
    assert (f"is below the file {f}" if below else "it is a file") in msg
    assert config.problems() == [msg]
    assert f.read_text() == "not a directory"  # nothing was made or changed


def test_problems_lists_every_invalid_setting(clean_env, tmp_path):
    assert config.problems() == []
    clean_env.setenv("FUSEKIT_CACHE_DIR", str(tmp_path / "fine" / "new"))  # missing is fine: it is made
    clean_env.setenv("FUSEKIT_PATTERNS", str(tmp_path))
    assert config.problems() == []
    f = tmp_path / "f"
    f.write_text("")
    clean_env.setenv("FUSEKIT_CACHE_DIR", str(f))
    clean_env.setenv("FUSEKIT_CACHE_SIZE", "lots")
    clean_env.setenv("FUSEKIT_MODE", "fast")
    clean_env.setenv("FUSEKIT_PATTERNS", f"{tmp_path}{os.pathsep}{tmp_path / 'nope'}{os.pathsep}{f}")
    found = config.problems()
    assert len(found) == 5, found
    for var, value in (("FUSEKIT_CACHE_DIR", str(f)), ("FUSEKIT_CACHE_SIZE", "lots"), ("FUSEKIT_MODE", "fast")):
        assert any(p.startswith(f"{var}={value!r} is invalid: expected ") for p in found), var
    assert any("FUSEKIT_PATTERNS" in p and repr(str(tmp_path / "nope")) in p and "missing" in p for p in found)
    assert any("FUSEKIT_PATTERNS" in p and repr(str(f)) in p and "a file" in p for p in found)
