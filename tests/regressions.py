"""Every failure the GPU fuzzer (tests/test_gpu_fuzz.py) has found, kept as an explicit case.

``REGRESSIONS[test]`` lists the ``case`` dicts of one fuzz test; each runs first, on every run, as a
hypothesis ``@example`` (a failure that was fixed must stay fixed). To add one: copy the
"Falsifying example: test_...(case={...})" dict hypothesis printed into the list of that test, with
a comment naming the date, the symptom and the fix (commit). A case is plain data: shapes,
attributes, dtype, layout and the data seed, so it replays the same inputs.

None yet: no fuzz run has failed (first device run pending).
"""

from __future__ import annotations

REGRESSIONS: dict[str, list[dict]] = {
    "conv_forward": [],
    "conv_backward": [],
    "conv_transpose": [],
    "linear": [],
    "batchnorm": [],
    "layernorm": [],
    "pooling": [],
    "softmax": [],
}
