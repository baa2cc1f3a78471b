"""CPU: the numerics policy (allow_tf32), the workspace out-of-memory fallback and dispatch state that
stays bounded under a stream of new keys, through the real dispatch, keys, cache and build sequence
with a fake GPU: fake device arrays read by a fake Adapter, and a fake cuDNN graph whose ranked plan
list (name, workspace bytes, TF32 or not) each test chooses. No GPU, no cuDNN handle.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import tracemalloc
import warnings
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
from plankeys import key as plan_key

import fusekit
from fusekit import adapters, config, dispatch, tensors
from fusekit.engine import cache as cache_mod
from fusekit.engine import keys, runtime
from fusekit.engine import lower as lower_mod
from fusekit.engine.cache import DiskStore, EntryError, PlanCache
from fusekit.errors import CacheWarning, NumericsWarning, SettingError, WorkspaceWarning
from fusekit.errors import forget_warnings
from fusekit.dispatch import calls, choice, execute, resolve

cudnn = pytest.importorskip("cudnn")  # enums only (numerical notes, heuristic modes): no GPU needed


# ----------------------------------------------------------------------------------------------
# a fake GPU
# ----------------------------------------------------------------------------------------------
class Dev:
    """A 'device array' that only knows its metadata (row-major, or channels-last for 4-D NHWC)."""

    _next = 0x7F00_0000_0000

    def __init__(self, shape, dtype="float32", layout="ROW"):
        self.shape, self.dtype = tuple(shape), dtype
        if layout == "NHWC":
            _, c, h, w = self.shape
            self.strides = (h * w * c, 1, w * c, c)
        else:
            self.strides = tuple(int(s) for s in np.cumprod((1,) + self.shape[:0:-1])[::-1]) if self.shape else ()
        Dev._next += 1 << 20
        self.ptr = Dev._next


class OutOfMemoryError(MemoryError):
    """What CuPy raises (and what torch.OutOfMemoryError is named)."""


class DevAdapter(adapters.Adapter):
    name = "fakedev"

    def __init__(self):
        self.room: int | None = None  # largest allocation that succeeds (None: any)
        self.allocations: list[int] = []

    def probe(self, a):
        return (a.shape, a.strides, a.dtype, 0, tensors.alignment(a.ptr)), a.ptr

    def describe(self, a):
        return a.shape, a.strides, a.dtype, 0

    def stream(self, device):
        return 0

    def device_properties(self, device):
        return "Fake GPU", (9, 0)

    def empty(self, spec):
        return Dev(spec.view or spec.shape, spec.dtype, spec.layout if spec.layout == "NHWC" else "ROW")

    def bytes(self, nbytes, device):
        if self.room is not None and nbytes > self.room:
            raise OutOfMemoryError(f"out of memory allocating {nbytes} bytes")
        self.allocations.append(nbytes)
        return object(), 0x7E00_0000_0000

    def use_device(self, device):
        return contextlib.nullcontext()


class Graph:
    """A cuDNN frontend graph as build_plans drives it: a ranked plan list ``plans`` of
    (name, workspace bytes, uses TF32), note and workspace filters, the first surviving plan built."""

    def __init__(self, plans):
        self.plans = list(plans)
        self.excluded: list = []
        self.limit: int | None = None
        self._plan_index = 0
        self.executed = 0

    def validate(self):
        pass

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        assert modes, "no heuristic modes"

    def deselect_numeric_notes(self, notes):
        self.excluded += list(notes)

    def deselect_workspace_greater_than(self, n):
        self.limit = n

    def check_support(self):
        pass

    def _allowed(self, plan):
        _, ws, tf32 = plan
        if tf32 and cudnn.numerical_note.TENSOR_CORE in self.excluded:
            return False
        return self.limit is None or ws <= self.limit

    def build_plans(self, *policy):
        ok = [i for i, p in enumerate(self.plans) if self._allowed(p)]
        if not ok:
            raise RuntimeError("no plan in the list could be built")
        self._plan_index = ok[0]

    def get_workspace_size(self):
        return self.plans[self._plan_index][1]

    def get_execution_plan_count(self):
        return len(self.plans)

    def get_plan_name_at_index(self, i):
        return self.plans[i][0]

    def get_engine_and_knobs_at_index(self, i):
        return i, {}

    def execute(self, arrays, workspace, handle=None, tensor_uids=None):
        self.executed += 1

    def serialize(self, as_bytes=False):
        return json.dumps(self.plans[self._plan_index]).encode()


class World:
    """The fake GPU's state: the plan list every new graph offers, the adapter, the graphs made."""

    def __init__(self):
        self.plans = [("eng0", 0, False)]
        self.adapter = DevAdapter()
        self.graphs: list[Graph] = []
        self.released = 0

    def lower(self, pattern, specs, attrs, handle=None):
        g = Graph(self.plans)
        self.graphs.append(g)
        names = pattern.operand_names + tuple(pattern.outputs)
        return lower_mod.Lowered(g, names, tuple(range(len(names))))

    def deserialize(self, blob, handle):
        g = Graph([tuple(json.loads(blob))])
        self.graphs.append(g)
        return g


@pytest.fixture
def world(monkeypatch, tmp_path, fresh_session):
    w = World()
    rt = runtime.Runtime()
    handle = SimpleNamespace(stream=0)
    with adapters.registered(Dev, w.adapter):
        yield from _world(monkeypatch, w, rt, handle, fresh_session)


def _world(monkeypatch, w, rt, handle, fresh_session):
    monkeypatch.setattr(keys, "versions", lambda: runtime.Versions(91900, "1.32.0"))
    fresh_session.runtime = rt
    monkeypatch.setattr(runtime.Runtime, "handle", lambda self, ad, device, stream, create=True: handle)
    monkeypatch.setattr(execute, "load_cudnn", lambda: SimpleNamespace(set_stream=lambda h, s: setattr(h, "stream", s)))
    monkeypatch.setattr(lower_mod, "lower", w.lower)
    monkeypatch.setattr(lower_mod, "deserialize", w.deserialize)

    def release():
        w.released += 1

    monkeypatch.setattr(runtime, "release_cached_memory", release)
    for var in config.SETTINGS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", "off")  # never the user's cache directory
    fresh_session.cache = PlanCache(maxsize=64, store=None)
    w.rt, w.handle = rt, handle
    yield w


def linear_operands(batch=7, fin=300, fout=77, dtype="float32"):
    return Dev((batch, fin), dtype), Dev((fout, fin), dtype), Dev((fout,), dtype)


def conv_operands(dtype="float32", n=2):
    return Dev((n, 8, 9, 9), dtype, "NHWC"), Dev((16, 8, 3, 3), dtype, "NHWC"), Dev((16,), dtype)


def caught(fn, *args, **kw):
    """(result, [warnings]) of fn(*args, **kw), every warning recorded."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = fn(*args, **kw)
    return out, got


def of(category, got):
    return [w for w in got if issubclass(w.category, category)]


# ----------------------------------------------------------------------------------------------
# the setting: configure(allow_tf32=...) and FUSEKIT_ALLOW_TF32
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "conv", "matmul"),
    [
        (None, True, False), ("", True, False), ("default", True, False),
        (True, True, True), (False, False, False),
        ("all", True, True), ("1", True, True), ("ON", True, True), ("true", True, True),
        ("none", False, False), ("0", False, False), ("off", False, False),
        ("conv", True, False), ("matmul", False, True), ("conv,matmul", True, True), (" matmul + conv ", True, True),
        ({"matmul": True}, True, True), ({"conv": False}, False, False), ({}, True, False),
        (config.Tf32Policy(conv=False, matmul=True), False, True),
    ],
)
def test_policy_values(value, conv, matmul):
    p = config.tf32_policy(value)
    assert (p.conv, p.matmul) == (conv, matmul)
    assert (p.allows("conv"), p.allows("matmul")) == (conv, matmul)
    assert config.tf32_policy(str(p)) == p  # str() is a value the setting takes back


def test_default_policy_is_pytorchs():
    """torch.backends.cudnn.allow_tf32 defaults to True, torch.backends.cuda.matmul.allow_tf32 to False."""
    assert config.Tf32Policy() == config.Tf32Policy(conv=True, matmul=False)
    assert str(config.Tf32Policy()) == "conv" and config.TF32_FAMILIES == ("conv", "matmul")


@pytest.mark.parametrize("bad", ["yes please", "conv,linear", ",", "2", {"linear": True}, {"conv": 1}, 1, 0.5, ["conv"]])
def test_bad_policy_values_are_setting_errors(bad):
    with pytest.raises(SettingError, match=r"^allow_tf32=.* is invalid: expected True / False, a mapping of conv / matmul"):
        config.tf32_policy(bad)


def test_env_variable_is_read_when_asked(monkeypatch, fresh_session):
    monkeypatch.delenv("FUSEKIT_ALLOW_TF32", raising=False)
    assert config.allow_tf32() == config.Tf32Policy()
    monkeypatch.setenv("FUSEKIT_ALLOW_TF32", "none")
    assert config.allow_tf32() == config.Tf32Policy(conv=False, matmul=False)
    monkeypatch.setenv("FUSEKIT_ALLOW_TF32", "matmul")
    assert config.allow_tf32() == config.Tf32Policy(conv=False, matmul=True)
    monkeypatch.setenv("FUSEKIT_ALLOW_TF32", "fast")
    with pytest.raises(SettingError, match=r"^FUSEKIT_ALLOW_TF32='fast' is invalid: expected "):
        config.allow_tf32()
    assert any(p.startswith("FUSEKIT_ALLOW_TF32='fast' is invalid") for p in config.problems())
    assert ("FUSEKIT_ALLOW_TF32", "fast") in config.describe()
    monkeypatch.delenv("FUSEKIT_ALLOW_TF32")
    assert dict(config.describe())["FUSEKIT_ALLOW_TF32"].startswith("(unset: PyTorch")


def test_policy_follows_pytorchs_switches(world, monkeypatch):
    """Unset, the policy is PyTorch's flags as they are now (cudnn.allow_tf32 for convolutions,
    cuda.matmul.allow_tf32, which set_float32_matmul_precision sets, for matmuls); the variable and
    configure() override them; without PyTorch imported, PyTorch's defaults."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("FUSEKIT_ALLOW_TF32", raising=False)
    fusekit.configure(disk=False)
    cudnn_flag, matmul_precision = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("high")
        assert config.torch_tf32_flags() == (False, True)
        assert config.allow_tf32() == config.Tf32Policy(conv=False, matmul=True)
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")
        assert config.allow_tf32() == config.Tf32Policy(conv=True, matmul=False)
        torch.backends.cudnn.allow_tf32 = False
        monkeypatch.setenv("FUSEKIT_ALLOW_TF32", "all")
        assert config.allow_tf32() == config.Tf32Policy(True, True)
        monkeypatch.delenv("FUSEKIT_ALLOW_TF32")
        fusekit.configure(disk=False, allow_tf32="conv")
        assert config.allow_tf32() == config.Tf32Policy(conv=True, matmul=False)
        fusekit.configure(disk=False)
        assert config.allow_tf32() == config.Tf32Policy(conv=False, matmul=False)
        monkeypatch.delitem(sys.modules, "torch")
        assert config.torch_tf32_flags() is None and config.allow_tf32() == config.Tf32Policy()
    finally:
        torch.backends.cudnn.allow_tf32 = cudnn_flag
        torch.set_float32_matmul_precision(matmul_precision)


def test_dispatch_keys_carry_pytorchs_switches(monkeypatch):
    """A call resolved under one setting of PyTorch's flags is not reused under another: the
    dispatch key ends with the flags."""
    from fusekit import dispatch

    flags = [(True, False)]
    monkeypatch.setattr(config, "torch_tf32_flags", lambda: flags[0])
    monkeypatch.setitem(adapters.SIGNATURES, _Sig, lambda a: [a.shape, (3, 1), "float16", a.device, 0])
    monkeypatch.setitem(adapters.STREAMS, _Sig, lambda device: 0)
    a = _Sig((2, 3), 0)
    k1 = calls.call_key("conv_bias", (), (), (a,), True)
    flags[0] = (False, False)
    k2 = calls.call_key("conv_bias", (), (), (a,), True)
    assert k1 != k2 and k1[-1] == (True, False) and k2[-1] == (False, False)


class _Sig:
    def __init__(self, shape, device):
        self.shape, self.device = shape, device


def test_configure_sets_the_policy_over_the_environment(world, monkeypatch):
    monkeypatch.setenv("FUSEKIT_ALLOW_TF32", "all")
    assert config.allow_tf32() == config.Tf32Policy(True, True)
    c = fusekit.configure(disk=False, allow_tf32=False)
    assert fusekit.default_cache() is c and config.allow_tf32() == config.Tf32Policy(False, False)
    fusekit.configure(disk=False, allow_tf32={"matmul": True})
    assert config.allow_tf32() == config.Tf32Policy(True, True)
    fusekit.configure(disk=False)  # None: the environment again
    assert config.allow_tf32() == config.Tf32Policy(True, True)
    monkeypatch.delenv("FUSEKIT_ALLOW_TF32")
    assert config.allow_tf32() == config.Tf32Policy()


def test_a_bad_configure_changes_nothing(world):
    before = fusekit.default_cache()
    fusekit.configure(disk=False, allow_tf32="matmul")
    current = fusekit.default_cache()
    with pytest.raises(SettingError, match="allow_tf32"):
        fusekit.configure(disk=False, allow_tf32="sometimes")
    assert fusekit.default_cache() is current is not before
    assert config.allow_tf32() == config.Tf32Policy(conv=False, matmul=True)


# ----------------------------------------------------------------------------------------------
# the key records the policy
# ----------------------------------------------------------------------------------------------
def _key(world, pattern, operands):
    return dispatch.plan_for(pattern, *operands).key


def test_key_field_follows_the_policy_per_family(world):
    assert _key(world, "conv_bias_relu", conv_operands()).tf32 is True  # convolutions: TF32 by default
    assert _key(world, "linear_bias", linear_operands()).tf32 is False  # matmuls: IEEE by default
    assert _key(world, "conv_bias_relu", conv_operands("float16")).tf32 is False  # TF32 is about float32 only
    bn = [Dev((2, 8, 6, 6), "float32", "NHWC")] + [Dev((8,), "float32") for _ in range(4)]
    assert _key(world, "batchnorm", bn).tf32 is False  # no convolution or matmul
    fusekit.configure(disk=False, allow_tf32="matmul")
    assert _key(world, "conv_bias_relu", conv_operands()).tf32 is False
    assert _key(world, "linear_bias", linear_operands()).tf32 is True
    assert "TF32 allowed" in _key(world, "linear_bias", linear_operands()).describe()


def test_policy_changes_float32_keys_only(world):
    """A policy change gives float32 convolutions new keys (and new plans); float16 keys stay."""
    k32, k16 = _key(world, "conv", conv_operands()[:2]), _key(world, "conv", conv_operands("float16")[:2])
    fusekit.configure(disk=False, allow_tf32=False)
    k32b, k16b = _key(world, "conv", conv_operands()[:2]), _key(world, "conv", conv_operands("float16")[:2])
    assert k32 != k32b and k32.fingerprint() != k32b.fingerprint() and (k32.tf32, k32b.tf32) == (True, False)
    assert k16 == k16b


def test_resolved_calls_follow_a_new_policy(world, fresh_session):
    """configure() drops the resolved calls: the next call makes a key under the new policy."""
    x, w, b = linear_operands()
    fusekit.linear_bias(x, w, b)
    assert [c.plan.key.tf32 for c in fresh_session.calls.values()] == [False]
    fusekit.configure(disk=False, allow_tf32=True)
    assert fresh_session.calls == {}
    fusekit.linear_bias(x, w, b)
    assert [c.plan.key.tf32 for c in fresh_session.calls.values()] == [True]


# ----------------------------------------------------------------------------------------------
# the build: TF32 plans excluded unless allowed; a key with no IEEE plan takes TF32, said once
# ----------------------------------------------------------------------------------------------
TF32_ONLY = [("gemm_tf32", 0, True)]
BOTH = [("gemm_tf32", 0, True), ("gemm_fma", 0, False)]


def test_ieee_plan_is_chosen_when_the_policy_forbids_tf32(world):
    world.plans = BOTH
    _, got = caught(fusekit.linear_bias, *linear_operands())
    plan = dispatch.plan_for("linear_bias", *linear_operands())
    assert plan.engine == "gemm_fma" and not of(NumericsWarning, got)
    g = world.graphs[0]
    assert {cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS} <= set(g.excluded)
    assert not lower_mod.is_tf32_fallback(g)


def test_tf32_plan_is_chosen_when_the_policy_allows_it(world):
    world.plans = BOTH
    fusekit.configure(disk=False, allow_tf32={"matmul": True})
    _, got = caught(fusekit.linear_bias, *linear_operands())
    assert dispatch.plan_for("linear_bias", *linear_operands()).engine == "gemm_tf32" and not of(NumericsWarning, got)
    # only the plans that down-convert float32 inputs to 16 bits are filtered (as PyTorch): TF32 stays in
    assert world.graphs[0].excluded == [cudnn.numerical_note.DOWN_CONVERT_INPUTS]


def test_float32_key_with_only_tf32_plans_warns_once_per_key(world):
    """A float32 Linear whose only plans are TF32: now said, once per key,
    naming the pattern and the shapes."""
    world.plans = TF32_ONLY
    x, w, b = linear_operands()
    _, got = caught(fusekit.linear_bias, x, w, b)
    (warned,) = of(NumericsWarning, got)
    msg = str(warned.message)
    assert "linear_bias(" in msg and "x=float32[1, 7, 300]" in msg and "w=float32[1, 300, 77]" in msg
    assert "no IEEE float32 plan" in msg and "allow_tf32" in msg and "matmul" in msg
    assert warned.filename == __file__  # points at the caller's line
    plan = dispatch.plan_for("linear_bias", x, w, b)
    assert plan.engine == "gemm_tf32" + lower_mod.TF32_FALLBACK and plan.key.tf32 is False
    assert lower_mod.is_tf32_fallback(plan.graph)
    for _ in range(3):  # the same call: the dispatch table, no warning
        assert not of(NumericsWarning, caught(fusekit.linear_bias, x, w, b)[1])
    dispatch.clear_dispatch()  # resolved again: a cache hit, already said
    assert not of(NumericsWarning, caught(fusekit.linear_bias, *linear_operands())[1])
    _, got = caught(fusekit.linear_bias, *linear_operands(batch=9))  # another key: said again
    assert len(of(NumericsWarning, got)) == 1 and "x=float32[1, 9, 300]" in str(of(NumericsWarning, got)[0].message)


def test_the_warning_can_be_made_an_error(world):
    world.plans = TF32_ONLY
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericsWarning)
        with pytest.raises(NumericsWarning):
            fusekit.linear_bias(*linear_operands())


def test_float16_and_allowed_keys_never_warn(world):
    world.plans = TF32_ONLY
    _, got = caught(fusekit.linear_bias, *linear_operands(dtype="float16"))
    _, got2 = caught(fusekit.conv_bias_relu, *conv_operands(), padding=1)  # float32 conv: TF32 allowed by default
    assert not of(NumericsWarning, got + got2)
    # float16: nothing filtered; the float32 conv (TF32 allowed): only 16-bit input plans
    assert world.graphs[0].excluded == [] and world.graphs[1].excluded == [cudnn.numerical_note.DOWN_CONVERT_INPUTS]


def test_tf32_fallback_is_recorded_with_the_stored_plan(world, tmp_path):
    """A plan loaded from disk in a later process says it is a TF32 fallback too, and warns there."""
    world.plans = TF32_ONLY
    cache = fusekit.configure(cache_dir=tmp_path / "plans")
    assert len(of(NumericsWarning, caught(fusekit.linear_bias, *linear_operands())[1])) == 1
    assert cache.stats.disk_writes == 1
    # a new process: an empty memory cache on the same store, nothing warned yet
    forget_warnings()
    cache = fusekit.configure(cache_dir=tmp_path / "plans")
    _, got = caught(fusekit.linear_bias, *linear_operands())
    assert cache.stats.disk_hits == 1 and cache.stats.builds == 0
    assert len(of(NumericsWarning, got)) == 1
    assert dispatch.plan_for("linear_bias", *linear_operands()).source == "disk"


def test_entries_of_the_old_key_format_are_refused_and_rebuilt(tmp_path):
    """Entries written before PlanKey.tf32 existed never match a key now; one found at a key's path
    is moved aside with a warning and rebuilt, and `verify` names it, never a crash."""
    store = DiskStore(tmp_path / "store")
    k = plan_key(tf32=True)
    store.write(k, {"engine": "eng0", "uids": [0, 1, 2, 3], "workspace_size": 0}, b"blob")
    path = store.path(k)
    head, blob = path.read_bytes().split(b"\n", 1)
    header = json.loads(head)
    del header["key"]["tf32"]  # as fusekit wrote keys before the numerics policy
    path.write_bytes(json.dumps(header).encode() + b"\n" + blob)
    with pytest.raises(EntryError, match=r"unreadable key \(the key has no tf32 \(an entry of an older fusekit\)\)"):
        store.load(path)
    assert [p for p, _ in store.verify()] == [path]
    with pytest.warns(CacheWarning, match="older fusekit"):
        assert store.read(k) is None
    assert not path.exists()
    cache = PlanCache(maxsize=2, store=store)
    built = cache.get_or_build(k, lambda: cache_mod.Plan(k, SimpleNamespace(serialize=lambda as_bytes: b"new"), (0,), 0, "eng", 1, 0.0),
                               lambda e: pytest.fail("an old entry was loaded"))
    assert built.engine == "eng" and cache.stats.builds == 1 and store.read(k) is not None


# ----------------------------------------------------------------------------------------------
# workspace out of memory: free cached memory and retry, then a plan with a smaller workspace
# ----------------------------------------------------------------------------------------------
MiB = 1 << 20
LADDER = [("big_ws", 512 * MiB, False), ("mid_ws", 8 * MiB, False), ("no_ws", 0, False)]


def test_workspace_that_does_not_fit_falls_back_to_a_smaller_plan_once(world, fresh_session):
    world.plans = LADDER
    world.adapter.room = 16 * MiB
    x, w, b = conv_operands("float16")
    _, got = caught(fusekit.conv_bias_relu, x, w, b, padding=1)
    (warned,) = of(WorkspaceWarning, got)
    msg = str(warned.message)
    assert "536870912-byte cuDNN workspace of conv_bias_relu(" in msg and "mid_ws with a 8388608-byte workspace" in msg
    assert world.released == 1  # cached memory was freed and the allocation tried again first
    assert warned.filename == __file__
    plan = dispatch.plan_for("conv_bias_relu", x, w, b, padding=1)
    assert plan.engine == "mid_ws" and plan.workspace_size == 8 * MiB
    cached = fusekit.default_cache().get(plan.key)
    assert cached is not plan and cached.engine == "big_ws"  # the cache keeps the key's own plan
    (call,) = fresh_session.calls.values()
    assert call.plan.engine == "mid_ws" and call.origin is cached
    runs = call.graph.executed
    for _ in range(3):
        assert not of(WorkspaceWarning, caught(fusekit.conv_bias_relu, x, w, b, padding=1)[1])
    assert call.graph.executed == runs + 3
    fusekit.default_cache().clear()  # the key's plan leaves the cache: its stand-in call goes too
    assert fresh_session.calls == {}


def test_fallback_walks_down_to_a_plan_without_workspace(world):
    world.plans = LADDER
    world.adapter.room = 0
    _, got = caught(fusekit.conv_bias_relu, *conv_operands("float16"), padding=1)
    assert len(of(WorkspaceWarning, got)) == 1 and "no_ws with a 0-byte workspace" in str(of(WorkspaceWarning, got)[0].message)
    assert [g.limit for g in world.graphs] == [None, 512 * MiB - 1, 8 * MiB - 1]


def test_no_plan_fits_raises_the_out_of_memory_error(world, fresh_session):
    world.plans = LADDER[:1]
    world.adapter.room = MiB
    with pytest.raises(OutOfMemoryError, match="out of memory allocating 536870912 bytes"):
        fusekit.conv_bias_relu(*conv_operands("float16"), padding=1)
    assert fresh_session.calls == {}
    world.adapter.room = None  # memory came back: the key's own plan runs
    _, got = caught(fusekit.conv_bias_relu, *conv_operands("float16"), padding=1)
    assert not got and [c.plan.engine for c in fresh_session.calls.values()] == ["big_ws"]


def test_other_allocation_errors_are_not_taken_for_out_of_memory(world, monkeypatch):
    world.plans = LADDER

    def broken(nbytes, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(world.adapter, "bytes", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fusekit.conv_bias_relu(*conv_operands("float16"), padding=1)
    assert world.released == 0 and len(world.graphs) == 1


def test_out_of_memory_errors_are_recognized():
    assert runtime.is_out_of_memory(OutOfMemoryError("x"))
    assert runtime.is_out_of_memory(MemoryError())
    assert runtime.is_out_of_memory(RuntimeError("cudaErrorMemoryAllocation: out of memory"))
    assert not runtime.is_out_of_memory(RuntimeError("CUDNN_STATUS_BAD_PARAM"))


def test_workspace_keeps_its_buffer_when_it_cannot_grow():
    ad = DevAdapter()
    ws = runtime.Workspace(ad, 0)
    ws.ensure(4 * MiB)
    assert ws.size == 4 * MiB and ws.ptr
    ad.room = 4 * MiB
    with pytest.raises(OutOfMemoryError):
        ws.ensure(64 * MiB)
    assert ws.size == 4 * MiB and ws.ptr  # taken back: calls bound to it still have their buffer
    ad.room = 0
    with pytest.raises(OutOfMemoryError):
        ws.ensure(64 * MiB)
    assert (ws.size, ws.ptr) == (0, 0)  # nothing left: dispatch drops the calls bound to it


def test_release_lets_go_of_calls_plans_and_workspaces(world, fresh_session):
    """fusekit.release() (also run at exit): the resolved call, the plan in memory, the workspace
    and the handle go; the next call builds again and runs."""
    x, w, b = conv_operands("float16")
    fusekit.conv_bias_relu(x, w, b, padding=1)
    cache = fusekit.default_cache()
    assert len(fresh_session.calls) == 1 and len(cache) == 1 and world.rt._workspaces
    built = len(world.graphs)
    fusekit.release()
    assert fresh_session.calls == {} and len(cache) == 0 and not world.rt._workspaces
    fusekit.conv_bias_relu(x, w, b, padding=1)
    assert len(world.graphs) == built + 1 and len(fresh_session.calls) == 1


def test_workspace_releases_nothing_during_a_capture(monkeypatch):
    """Out of memory inside a CUDA-graph capture: freeing cached device memory there would silently
    invalidate the capture (seen as a later execute's "previous error during capture"), so nothing is
    released and the workspace keeps its buffer."""
    released = []
    monkeypatch.setattr(runtime, "release_cached_memory", lambda: released.append(1))
    ad = DevAdapter()
    ws = runtime.Workspace(ad, 0)
    ws.ensure(4 * MiB)
    before = (ws.size, ws.ptr)
    ad.room = 4 * MiB
    monkeypatch.setattr(ad, "capturing", lambda device: True, raising=False)
    with pytest.raises(OutOfMemoryError):
        ws.ensure(64 * MiB)
    assert not released and (ws.size, ws.ptr) == before
    monkeypatch.setattr(ad, "capturing", lambda device: False)
    with pytest.raises(OutOfMemoryError):
        ws.ensure(64 * MiB)
    assert released == [1]  # outside a capture the cached blocks are released before the retry


def test_calls_bound_to_a_workspace_that_lost_its_buffer_are_dropped(world, fresh_session):
    world.plans = [("small", MiB, False)]
    x, w, b = conv_operands("float16")
    fusekit.conv_bias_relu(x, w, b, padding=1)  # the stream's workspace: 1 MiB
    assert len(fresh_session.calls) == 1
    world.plans = [("huge", 256 * MiB, False)]
    world.adapter.room = 0  # not even the old 1 MiB comes back
    with pytest.raises(OutOfMemoryError):
        fusekit.conv_bias_relu(*conv_operands("float16", n=3), padding=1)
    assert fresh_session.calls == {}  # the first call would have run with no workspace


# ----------------------------------------------------------------------------------------------
# a stream of new keys: the memory cache and dispatch's tables stay within FUSEKIT_CACHE_SIZE
# ----------------------------------------------------------------------------------------------
def test_many_keys_stay_within_the_cache_size(world, monkeypatch, fresh_session):
    monkeypatch.setenv("FUSEKIT_CACHE_SIZE", "8")
    fresh_session.cache = None
    world.plans = [("pointwise", 0, False)]
    cache = fusekit.default_cache()
    assert cache.maxsize == 8

    def run(i):
        x = Dev((1, 4, 2 + i // 64, 2 + i % 64), "float16", "NHWC")
        fusekit.call("relu", x)

    sizes = []
    tracemalloc.start()
    try:
        for i in range(3000):
            run(i)
            if i in (999, 2999):
                world.graphs.clear()  # the test's own record of graphs
                gc.collect()
                sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert len(cache) == 8 and cache.stats.builds == 3000 and cache.stats.evictions == 2992
    assert len(fresh_session.calls) <= 8 and fresh_session.refused == {}
    assert len(world.rt._workspaces) == 1
    assert sizes[1] - sizes[0] < 256 * 1024, f"traced memory grew by {sizes[1] - sizes[0]} bytes over 2000 new keys"


def test_dispatch_table_follows_every_new_cache(world, fresh_session):
    """Each cache configure() makes gets dispatch's eviction hook, even one that reuses the memory
    (the id) of a cache that is gone: else its evicted plans would stay in the dispatch table."""
    shapes = iter(range(10_000))
    for _ in range(6):
        fusekit.configure(disk=False, maxsize=2)
        gc.collect()  # the replaced cache is freed: its id may come back
        for _ in range(5):
            i = next(shapes)
            fusekit.call("relu", Dev((1, 4, 2 + i // 64, 2 + i % 64), "float16", "NHWC"))
        assert len(fresh_session.calls) <= 2, f"{len(fresh_session.calls)} dispatch entries for a cache of 2 plans"


def test_refused_keys_are_remembered_within_the_cache_size_and_without_their_graphs(world, monkeypatch, fresh_session):
    """A key cuDNN refuses is remembered (not rebuilt on every call), but only as many as the cache
    holds plans, and as its message: the traceback would keep the failed graphs alive."""
    fresh_session.cache = PlanCache(maxsize=4, store=None)
    world.plans = [("nhwc_only", 0, False)]
    real_lower = world.lower

    def nchw_refused(pattern, specs, attrs, handle=None):
        low = real_lower(pattern, specs, attrs, handle)
        if any(s.layout == "NCHW" and len(s.shape) == 4 and s.shape[1] > 1 for s in specs.values()):
            low.graph.plans = []  # no engine for NCHW: the call runs on channels-last copies
        return low

    monkeypatch.setattr(lower_mod, "lower", nchw_refused)
    world.adapter.relayout = lambda a, layout: Dev(a.shape, a.dtype, "NHWC" if layout == "NHWC" else "ROW")
    _, got = caught(lambda: [fusekit.call("relu", Dev((1, 4, 2 + i, 3), "float16", "NCHW")) for i in range(40)])
    assert [str(w.message)[:38] for w in got] == ["fusekit: cuDNN has no NCHW engine for "]  # said once
    assert len(fresh_session.refused) <= 4
    assert all(e.__traceback__ is None and e.__cause__ is None for e in fresh_session.refused.values())


# ----------------------------------------------------------------------------------------------
# tunables: one home, scoped overrides
# ----------------------------------------------------------------------------------------------
def test_settings_override_tunables_in_a_scope_and_restore_them():
    """``with fusekit.settings(...)`` sets the named tunables inside the block only (also when the
    block raises); the readers see the new values (the fused-or-split margin, here)."""
    from fusekit import dispatch

    before = config.TUNABLES.split_margin
    with fusekit.settings(split_margin=0.5, tapes=False) as t:
        assert t is config.TUNABLES and (t.split_margin, t.tapes) == (0.5, False)
        assert choice.split_wins((1.0, 0.6)) is False and choice.split_wins((1.0, 0.4)) is True
    assert config.TUNABLES.split_margin == before and config.TUNABLES.tapes is True
    with pytest.raises(RuntimeError), fusekit.settings(row_channels=8):
        assert config.TUNABLES.row_channels == 8
        raise RuntimeError("inside")
    assert config.TUNABLES.row_channels == 32


@pytest.mark.parametrize(("kw", "match"), [
    ({"split_margn": 0.9}, r"split_margn=0.9 is invalid: expected a tunable: one of"),
    ({"split_margin": 1.5}, r"split_margin=1.5 is invalid: expected a number from 0 to 1"),
    ({"split_margin": float("nan")}, r"split_margin=nan is invalid"),
    ({"tapes": "no"}, r"tapes='no' is invalid: expected True or False"),
    ({"tape_limit": 2.5}, r"tape_limit=2.5 is invalid: expected an integer"),
    ({"row_channels": 0}, r"row_channels=0 is invalid"),
    ({"leftover_age_s": True}, r"leftover_age_s=True is invalid"),
])
def test_bad_settings_change_nothing(kw, match):
    snapshot = dict(vars(config.TUNABLES))
    with pytest.raises(SettingError, match=match), fusekit.settings(**{"tape_limit": 10, **kw}):
        pass
    assert dict(vars(config.TUNABLES)) == snapshot
