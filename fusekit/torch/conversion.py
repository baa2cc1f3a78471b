"""``convert``: a model's ``torch.nn`` layers replaced by fusekit.torch modules, with the fusions its
graph allows (activations into their producers, residual adds into batch norms), and the report."""

from __future__ import annotations

import copy
import itertools
import operator
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import OperandError
from ..ops.common import ACTIVATIONS
from .modules import AvgPool2d, BatchNorm2d, Conv2d, ConvTranspose2d, Linear, LogSoftmax, MaxPool2d, PASSING_ON, ReLU, ReLU6, Softmax, FusekitModule

F = torch.nn.functional

_TARGETS: dict[type, type] = {
    torch.nn.Conv2d: Conv2d, torch.nn.ConvTranspose2d: ConvTranspose2d, torch.nn.Linear: Linear,
    torch.nn.BatchNorm2d: BatchNorm2d, torch.nn.ReLU: ReLU, torch.nn.ReLU6: ReLU6, torch.nn.MaxPool2d: MaxPool2d,
    torch.nn.AvgPool2d: AvgPool2d,
    torch.nn.Softmax: Softmax, torch.nn.LogSoftmax: LogSoftmax,
}


@dataclass
class ConvertReport:
    """What :func:`convert` did. ``replaced``: (name, torch type, fusekit type); ``fused``: (module
    names in call order, what runs); ``left_alone``: (name, type, reason) for leaf modules kept as
    PyTorch's; ``notes``: fusion chances missed; ``analysis``: how the call order was found."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    fused: list[tuple[tuple[str, ...], str]] = field(default_factory=list)
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    analysis: str = ""
    route: str = "modules"  # how training steps run: "replayed" (fusekit.torch.replayed) or "modules"

    def counts(self) -> dict[str, int]:
        """Replaced modules per torch type."""
        out: dict[str, int] = {}
        for _, t, _ in self.replaced:
            out[t] = out.get(t, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [
            (f"fusekit.torch.convert: {len(self.replaced)} modules replaced, {len(self.fused)} fused groups, "
             f"{len(self.left_alone)} left alone ({self.analysis})"),
            "replaced: " + (", ".join(f"{t} x{n}" for t, n in self.counts().items()) or "nothing"),
        ]
        if self.fused:
            lines.append("fused:")
            lines += [f"  {' -> '.join(names)}: {what}" for names, what in self.fused]
        if self.left_alone:
            lines.append("left alone:")
            groups: dict[tuple[str, str], list[str]] = {}
            for name, t, why in self.left_alone:
                groups.setdefault((t, why), []).append(name)
            for (t, why), names in groups.items():
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                lines.append(f"  {shown} ({t}): {why}")
        if self.notes:
            lines.append("notes:")
            lines += [f"  {n}" for n in self.notes]
        if self.replaced and self.route == "replayed":
            lines.append("route: replayed (training steps replay their recorded kernels, fusekit.torch.replayed); "
                         "convert(..., route='modules') gives the plain modules; fusekit.torch.graphed(model) captures CUDA graphs")
        elif self.replaced:
            lines.append(f"route: {self.route}: uncaptured, every fusekit layer pays Python and cuDNN host time per call; for speed "
                         "replay the steps (fusekit.torch.replayed(model)) or capture them (fusekit.torch.graphed(model))")
        return "\n".join(lines)


_PRODUCERS = (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear, torch.nn.BatchNorm2d)


class FxTracer(torch.fx.Tracer):
    """A ``torch.fx`` tracer that keeps fusekit.torch modules as leaves (``call_module`` nodes), as the
    default tracer keeps ``torch.nn`` modules; tracing through them records PyTorch's ops instead."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:  # type: ignore[override]
        return isinstance(m, FusekitModule) or super().is_leaf_module(m, module_qualified_name)


def _relu_node(model: torch.nn.Module, n: Any) -> bool:
    """Whether fx node ``n`` calls a module whose output is a ReLU's (a ReLU or ReLU6, or a layer with a fused one)."""
    if n.op != "call_module":
        return False
    m = model.get_submodule(n.target)
    return isinstance(m, (torch.nn.ReLU, torch.nn.ReLU6)) or getattr(m, "activation", None) in ACTIVATIONS


def _fx_consumers(model: torch.nn.Module) -> tuple[dict[int, int], list[str], dict[int, str]]:
    """From ``torch.fx`` traces of ``model`` in training and in eval mode: producer -> consumer (module
    ids) where every call of the producer feeds exactly one call of the same module and nothing else,
    in both traces; notes on outputs that feed a functional ReLU; and the convolutions (module id ->
    the ReLU module's name) whose every training call takes a ReLU module's output that nothing else
    uses. Raises what tracing raises."""
    modes = [(m, m.training) for m in model.modules()]
    found: list[dict[int, int]] = []
    notes: list[str] = []
    relu_fed: dict[int, str] = {}
    relu_fns = {F.relu, torch.relu, F.relu6}
    try:
        for mode in (True, False):
            model.train(mode)
            graph = FxTracer().trace(model)
            calls: dict[str, list[Any]] = {}
            for n in graph.nodes:
                if n.op == "call_module":
                    calls.setdefault(n.target, []).append(n)
            links: dict[int, int] = {}
            for target, nodes in calls.items():
                consumers = set()
                for n in nodes:
                    users = list(n.users)
                    u = users[0] if len(users) == 1 else None
                    if u is not None and u.op == "call_module" and len(u.args) == 1 and u.args[0] is n and not u.kwargs:
                        consumers.add(u.target)
                    else:
                        consumers.add(None)
                        functional_relu = u is not None and (
                            (u.op == "call_function" and u.target in relu_fns) or (u.op == "call_method" and u.target in ("relu", "relu_"))
                        )
                        if mode and functional_relu and isinstance(model.get_submodule(target), _PRODUCERS):
                            notes.append(f"{target}: its output goes to a functional ReLU in forward(); not fused (no module to swap)")
                if len(consumers) == 1 and None not in consumers:
                    links[id(model.get_submodule(target))] = id(model.get_submodule(consumers.pop()))
                if mode and isinstance(model.get_submodule(target), torch.nn.Conv2d) and all(
                    len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], torch.fx.Node) and _relu_node(model, n.args[0])
                    and len(n.args[0].users) == 1 for n in nodes
                ):
                    relu_fed[id(model.get_submodule(target))] = str(nodes[0].args[0].target)
            found.append(links)
    finally:
        for m, t in modes:
            m.training = t
    train, evaluate = found
    return {p: c for p, c in train.items() if evaluate.get(p) == c}, notes, relu_fed


def _sequential_consumers(model: torch.nn.Module) -> dict[int, int]:
    """Producer -> consumer (module ids) for consecutive children of plain nn.Sequential containers,
    each producer appearing once in the model."""
    seen: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    links: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Sequential) and type(m).forward is torch.nn.Sequential.forward:
            kids = [k for k in m._modules.values() if k is not None]
            for a, b in itertools.pairwise(kids):
                if seen.get(id(a)) == 1:
                    links[id(a)] = id(b)
    return links


def _link(producer: Any, consumer: Any) -> bool:
    """Make ``producer`` do ``consumer``'s work too, where fusekit has the fused graph."""
    if producer.activation is not None or producer._fk_bn is not None or producer._fk_relu is not None or producer._fk_after is not None:
        return False
    if isinstance(producer, (Conv2d, ConvTranspose2d, Linear, BatchNorm2d)) and type(consumer) in PASSING_ON:  # SiLU, Hardswish, ...
        consumer.__class__ = PASSING_ON[type(consumer)]
        producer.__dict__["_fk_after"] = consumer
        return True
    if isinstance(producer, Conv2d) and isinstance(consumer, BatchNorm2d):
        if consumer.num_features != producer.out_channels:
            return False
        producer.__dict__["_fk_bn"] = consumer
        return True
    if isinstance(producer, (Conv2d, ConvTranspose2d, Linear, BatchNorm2d)) and isinstance(consumer, ReLU):
        producer.__dict__["_fk_relu"] = consumer
        return True
    if isinstance(producer, (Conv2d, BatchNorm2d)) and isinstance(consumer, ReLU6):  # the graphs with a clipped ReLU
        producer.__dict__["_fk_relu"] = consumer
        return True
    return False


def _describe_groups(model: torch.nn.Module, names: dict[int, str]) -> list[tuple[tuple[str, ...], str]]:
    groups: list[tuple[tuple[str, ...], str]] = []
    in_chain: set[int] = set()
    mods = [m for m in model.modules() if isinstance(m, FusekitModule)]
    for m in mods:
        bn = m._fk_bn
        if bn is not None:
            after = bn._fk_relu or bn._fk_after
            in_chain.add(id(bn))
            if after is not None and bn._fk_after is not None:
                a = type(after).__name__
                groups.append(((names[id(m)], names[id(bn)], names[id(after)]),
                               f"training: conv, then BN, then PyTorch's {a}; eval: one conv+bias+{a} graph (BN folded into the conv)"))
            elif after is not None:
                a = type(after).__name__
                groups.append(((names[id(m)], names[id(bn)], names[id(after)]),
                               f"training: conv, then BN+{a} as one graph; eval: one conv+bias+{a} graph (BN folded into the conv)"))
            else:
                groups.append(((names[id(m)], names[id(bn)]), "training: conv, then BN; eval: one conv+bias graph (BN folded into the conv)"))
    for m in mods:
        r = m._fk_relu
        if m._fk_after is not None and id(m) not in in_chain:
            a = type(m._fk_after).__name__
            groups.append(((names[id(m)], names[id(m._fk_after)]), f"{type(m).__name__} then {a}: {a} in the layer's graph without "
                           "autograd (eval; not in Linear's matmul graph, nor hardsigmoid, nor hardswish outside Conv2d), else PyTorch's after it"))
        if r is None or id(m) in in_chain:
            continue
        a = type(r).__name__
        what = {BatchNorm2d: f"BN+{a} as one graph (batch statistics in training, running statistics in eval)",
                Conv2d: f"conv+bias+{a} as one graph", ConvTranspose2d: f"transposed conv+bias+{a} as one graph",
                Linear: f"matmul+bias+{a} as one graph (float16 / bfloat16 / autocast; float32 with IEEE matmuls: PyTorch's linear, then {a})"}[type(m)]
        groups.append(((names[id(m)], names[id(r)]), what))
    return groups


class _ChildrenAsLeaves(torch.fx.Tracer):
    """Traces one module's own forward: every submodule it calls is a ``call_module`` node."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:  # type: ignore[override]
        return True


_ADDS = {operator.add, operator.iadd, torch.add}


def _is_add(n: Any) -> bool:
    return len(n.args) == 2 and not n.kwargs and (
        (n.op == "call_function" and n.target in _ADDS) or (n.op == "call_method" and n.target in ("add", "add_")))


def _is_plain_relu(block: torch.nn.Module, n: Any) -> bool:
    """Whether fx node ``n`` is a plain ReLU of its one argument: a fusekit ReLU module, F.relu / torch.relu, or .relu()."""
    if len(n.args) != 1:
        return False
    if n.op == "call_module":
        return type(block.get_submodule(n.target)) is ReLU and not n.kwargs
    if n.op == "call_function":
        return n.target in (F.relu, torch.relu) and set(n.kwargs) <= {"inplace"}
    return n.op == "call_method" and n.target in ("relu", "relu_") and not n.kwargs


def _residual_ends(block: torch.nn.Module, graph: Any) -> list[tuple[Any, Any, Any]]:
    """(bn, add, relu) nodes of ``graph`` (``block``'s forward) computing relu(bn(x) + r): a fusekit
    BatchNorm2d without an activation of its own, its output used by the add alone, the sum by the ReLU alone."""
    found = []
    for add in graph.nodes:
        if not _is_add(add) or len(add.users) != 1:
            continue
        relu = next(iter(add.users))
        if not _is_plain_relu(block, relu):
            continue
        for i, bn in enumerate(add.args):
            other = add.args[1 - i]
            if (isinstance(bn, torch.fx.Node) and isinstance(other, torch.fx.Node) and other is not bn and bn.op == "call_module"
                    and len(bn.args) == 1 and not bn.kwargs and len(bn.users) == 1):
                m = block.get_submodule(bn.target)
                if type(m) is BatchNorm2d and m._fk_act() is None:
                    found.append((bn, add, relu))
                    break
    return found


def _feeds_only(block: torch.nn.Module, x: Any, bn: Any) -> bool:
    """Whether fx node ``x`` is a call of a fusekit Conv2d on one tensor whose only user is ``bn``, the BN it folds into in eval."""
    return (x.op == "call_module" and len(x.args) == 1 and not x.kwargs and len(x.users) == 1
            and type(block.get_submodule(x.target)) is Conv2d and block.get_submodule(x.target)._fk_bn is block.get_submodule(bn.target))


def _fuse_residual_ends(model: torch.nn.Module, names: dict[int, str], report: ConvertReport) -> None:
    """Rewrite the forward of every module that ends a residual block as relu(bn(x) + r) (torchvision's
    BasicBlock / Bottleneck: ``out = bn3(...); out += identity; out = relu(out)``) into one call
    ``bn3(x, r)``: training runs BN + add + ReLU as one graph, its backward the residual's gradient and
    the BN backward (one graph where cuDNN has an engine). The conv before bn3, when it folds bn3 in eval, is handed r
    too (``conv3(h, r)``, called where r is ready): eval without autograd runs one conv + bias + add +
    ReLU graph. The module's forward becomes the rewritten trace (an instance
    attribute; the class, parameters and state-dict keys stay). A forward traced differently in training
    and eval mode, or not traceable, stays as it is."""
    for m in list(model.modules()):
        if isinstance(m, FusekitModule) or next(m.children(), None) is None or "forward" in m.__dict__:
            continue
        if type(m).forward is torch.nn.Sequential.forward:
            continue
        mode = m.training
        try:
            traces = []
            for training in (True, False):
                m.train(training)
                traces.append(_ChildrenAsLeaves().trace(m))
        except Exception:  # noqa: BLE001 - not traceable: left as it is
            continue
        finally:
            m.train(mode)
        graph = traces[0]
        if str(graph) != str(traces[1]):
            continue
        ends = _residual_ends(m, graph)
        if not ends:
            continue
        for bn, add, relu in ends:
            x, r = bn.args[0], add.args[1] if add.args[0] is bn else add.args[0]
            conv = x if _feeds_only(m, x, bn) else None
            with graph.inserting_before(add):  # after r's producer: a conv handed r is called there
                if conv is not None:
                    x = graph.call_module(conv.target, (conv.args[0], r))
                fused = graph.call_module(bn.target, (x, r))
            relu.replace_all_uses_with(fused)
            for n in (relu, add, bn) + ((conv,) if conv is not None else ()):
                graph.erase_node(n)
            prefix = "" if m is model else names[id(m)] + "."
            after = prefix + str(relu.target) if relu.op == "call_module" else "relu"
            report.fused.append(((prefix + str(bn.target), f"+ {r.name}", after),
                                 "training: BN + residual add + ReLU as one graph (backward: the residual's gradient and the BN "
                                 "backward, one graph where cuDNN has an engine); eval: "
                                 + ("conv + folded BN + add + ReLU as one graph without autograd, " if conv is not None else "")
                                 + "add + ReLU as one graph"))
        graph.lint()
        code = torch.fx.GraphModule(m, graph)
        m.forward = types.MethodType(type(code).forward, m)


def _reclass(model: torch.nn.Module, report: ConvertReport) -> dict[int, Any]:
    """Re-class every module of :data:`_TARGETS`' exact types as its fusekit.torch module (id -> module,
    fusekit modules already there included); the report says what was replaced and what stays PyTorch's."""
    converted: dict[int, Any] = {}
    for name, m in model.named_modules():
        if isinstance(m, FusekitModule):
            converted[id(m)] = m
            continue
        target = _TARGETS.get(type(m))
        if target is None:
            if next(m.children(), None) is None:  # a leaf: say why it stays PyTorch's
                base = next((t.__name__ for t in _TARGETS if isinstance(m, t)), None)
                why = (f"a subclass of torch.nn.{base} (its forward may differ): runs in PyTorch" if base
                       else "no fusekit module: runs in PyTorch")
                report.left_alone.append((name or "(root)", type(m).__name__, why))
            continue
        original = type(m)
        try:
            m.__class__ = target
            m._fk_setup()
        except OperandError as e:
            m.__class__ = original
            report.left_alone.append((name or "(root)", original.__name__, str(e)))
            continue
        converted[id(m)] = m
        report.replaced.append((name or "(root)", original.__name__, f"fusekit.torch.{target.__name__}"))
    return converted


def convert(module: torch.nn.Module, *, inplace: bool = False, fuse: bool = True, fuse_residual: bool = True,
            route: str = "replayed") -> tuple[torch.nn.Module, ConvertReport]:
    """Move ``module`` onto fusekit: every ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Linear``,
    ``nn.BatchNorm2d``, ``nn.ReLU``, ``nn.ReLU6``, ``nn.MaxPool2d``, ``nn.AvgPool2d``, ``nn.Softmax``
    and ``nn.LogSoftmax`` (exact types, not subclasses) becomes its fusekit.torch module: the same
    object re-classed, so parameters, buffers, hooks, state-dict keys and optimizer references stay.

    With ``fuse``, modules whose every call feeds exactly one call of the next (found from a
    ``torch.fx`` trace in training and eval mode, else from nn.Sequential order) run together:
    conv -> BN [-> ReLU or ReLU6] (training: conv, then the fused BN+ReLU graph; eval: BN folded into
    one conv+bias[+ReLU] graph), BN -> ReLU / ReLU6, conv -> ReLU / ReLU6, transposed conv / Linear ->
    ReLU, and any of those layers -> an ``nn.SiLU``, ``GELU``, ``Hardswish``, ``Hardsigmoid``,
    ``Sigmoid``, ``Tanh``, ``LeakyReLU`` or ``ELU`` module (its epilogue in the layer's graph where
    autograd records nothing, else PyTorch's after the graph; the module is re-classed so that it
    passes that output on). The producer then computes its followers' work and they pass its output on: calling a fused
    producer on its own returns the fused result (as torch.ao.quantization.fuse_modules does). A conv
    whose input is a ReLU or ReLU6 module's output that nothing else uses runs that ReLU's backward in
    its dgrad (training).
    With ``fuse_residual`` (and ``fuse``), each module whose forward ends a residual block as
    relu(bn(x) + r) (torchvision's BasicBlock / Bottleneck) is rewritten to end in one
    ``BatchNorm2d(x, r)`` call: BN + add + ReLU as one graph in training (backward: the residual's
    gradient with the BN backward, one graph where cuDNN has an engine); in eval without autograd the
    conv before it, its folded BN, the add and the ReLU as one graph (with autograd: the folded conv,
    then add + ReLU as one graph). That module's forward becomes its rewritten
    ``torch.fx`` trace (an instance attribute; class, parameters and state-dict keys stay);
    ``fuse_residual=False`` leaves every forward as it is.
    The links are plain attributes (not submodules, not in the state dict; deepcopy keeps them
    within the copy); nn.DataParallel's replicas would share the original's, so use
    DistributedDataParallel or ``fuse=False``.

    ``route="replayed"`` (the default) returns the model with its training steps replayed from tapes
    (:func:`fusekit.torch.replayed`: eval calls and steps it cannot replay run as the modules); a
    model with hooks, which a replay would skip, keeps ``"modules"``. ``route="modules"``: the plain
    modules. ``inplace=False`` converts a deep copy. Returns (model, report); ``print(report)`` lists
    what was replaced, fused and left alone, with reasons, and the route taken."""
    if not isinstance(module, torch.nn.Module):
        raise OperandError("fusekit.torch.convert", "module", f"expected a torch.nn.Module, got {type(module).__name__}", what="argument")
    if route not in ("replayed", "modules"):
        raise OperandError("fusekit.torch.convert", "route", f"expected 'replayed' or 'modules', got {route!r}", what="argument")
    model = module if inplace else copy.deepcopy(module)
    report = ConvertReport()
    names: dict[int, str] = {}
    for name, m in model.named_modules():
        names.setdefault(id(m), name or "(root)")

    links: dict[int, int] = {}
    relu_fed: dict[int, str] = {}
    if not fuse:
        report.analysis = "fusion off"
    else:
        try:
            links, report.notes, relu_fed = _fx_consumers(model)
            report.analysis = "call order from torch.fx traces in training and eval mode"
        except Exception as e:  # noqa: BLE001 - any tracing failure: fall back to Sequential order
            links = _sequential_consumers(model)
            report.analysis = f"call order from nn.Sequential containers only (torch.fx could not trace: {type(e).__name__}: {str(e)[:120]})"

    converted = _reclass(model, report)
    activations = {id(m): m for m in model.modules() if type(m) in PASSING_ON}  # left alone unless the layer before fuses them
    for p, c in links.items():
        if p in converted and (c in converted or c in activations):
            _link(converted[p], converted.get(c) or activations[c])
    fused_acts = {names[i] for i, m in activations.items() if isinstance(m, FusekitModule)}
    report.left_alone = [e for e in report.left_alone if e[0] not in fused_acts]
    report.fused = _describe_groups(model, names)
    if fuse and fuse_residual:
        _fuse_residual_ends(model, names, report)
    for i, relu in relu_fed.items():
        if isinstance(converted.get(i), Conv2d):
            converted[i].__dict__["_fk_drelu"] = True
            report.fused.append(((relu, names[i]), "training backward: the ReLU's backward runs in the conv's dgrad (one dgrad + dReLU graph)"))
    if route == "replayed":
        report.route = _replay(model)
    return model, report


def _replay(model: torch.nn.Module) -> str:
    """The route a converted model takes by default: replayed, unless it cannot be (hooks)."""
    from .graphs import replayed

    try:
        replayed(model)
    except OperandError as e:
        return f"modules ({e})"
    return "replayed"


