"""The engine, below the line: patterns -> cuDNN graphs -> plans, with no user arrays.

- ``patterns``: pattern files (TOML) read and checked; shape rules.
- ``oracle``: the same patterns executed in NumPy float64 (the correctness reference).
- ``lower``: the one lowering to a ``cudnn.pygraph`` and the one build sequence.
- ``keys``: operand specs checked against a pattern, output specs, the PlanKey.
- ``cache``: Plan, PlanKey, the on-disk store and the in-memory LRU.
- ``autotune``: time every candidate plan of a key; ``planner``: build, tune or load a key's plan.
- ``runtime``: cuDNN handles, workspaces, device and library versions.
"""
