"""fusekit.torch.replayed on the CPU: the recorder and replay on plain torch modules (aten ops only;
fusekit's graphs in a tape are checked on the GPU, test_gpu_torch_dropin)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
ft = pytest.importorskip("fusekit.torch")

from fusekit.errors import OperandError  # noqa: E402
from fusekit.dispatch import calls, execute, record  # noqa: E402
from stand_in_calls import call, launcher  # noqa: E402

F = torch.nn.functional


class Net(torch.nn.Module):
    """Conv, batch norm, a residual add, pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.c2(y) + y)
        return self.fc(y.mean((2, 3)))


def batches(n: int, shape: tuple = (4, 3, 12, 12)) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(shape, generator=g), torch.randint(0, 5, (shape[0],), generator=g)) for _ in range(n)]


def train(model: torch.nn.Module, data: list) -> tuple[list, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [t.detach().clone() for t in model.state_dict().values()]


def same_training(model: torch.nn.Module, data: list) -> torch.nn.Module:
    """Train ``model`` and a replayed copy of it on ``data``; assert bit-equal losses and state."""
    replay = ft.replayed(copy.deepcopy(model))
    want, got = train(model, data), train(replay, data)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    return replay


def test_replays_train_bit_for_bit_as_the_modules():
    torch.manual_seed(0)
    replay = same_training(Net(), batches(8))
    fw = replay.forward
    assert fw.replays == 4  # 2 warm-up calls, 2 recordings that agree, then replays
    (tape,) = fw.tapes.values()
    assert tape.fwd_end > 5 and len(tape.entries) > tape.fwd_end
    assert tape.drop, "forward slots the backward does not read are let go"


class Restride(Net):
    """An op that changes its argument's strides in place (as adaptive pooling's outputs get)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = super().forward(x) * 1
        t.as_strided_(t.shape[::-1], (1, t.shape[1]))
        return t.t()


class Lists(Net):
    """Ops taking lists of tensors (cat, stack) and keyword arguments (softmax's dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        z = torch.cat([y, torch.stack([y, y]).sum(0)], 1).softmax(1, dtype=torch.float64).float()
        return z[:, :5] + z[:, 5:]


def test_ops_on_lists_of_tensors_replay():
    torch.manual_seed(0)
    replay = same_training(Lists(), batches(6))
    assert replay.forward.replays == 2
    (tape,) = replay.forward.tapes.values()
    assert any(type(r).__name__ == "_Slots" for e in tape.entries for r in e[3] or ())


def test_an_in_place_restride_is_read_as_it_was_before_it():
    torch.manual_seed(0)
    assert same_training(Restride(), batches(6)).forward.replays == 2


class Mixed(torch.nn.Module):
    """Mixed precision by hand: parameters cast at each use (as autocast does), buffers updated in
    place (as batch norm's running statistics and batch count), detaches; ``read_back``: the forward
    reads a buffer after updating it."""

    def __init__(self, read_back: bool = False) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)
        self.register_buffer("m1", torch.zeros(8))
        self.register_buffer("m2", torch.zeros(5))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.read_back = read_back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.float64
        h = torch.relu(F.linear(x.to(d), self.l1.weight.to(d), self.l1.bias.to(d)))
        torch._foreach_copy_([self.m1], [h.mean(0).detach().float()])
        y = F.linear(h, self.l2.weight.to(d), self.l2.bias.to(d))
        torch._foreach_copy_([self.m2], [y.mean(0).detach().float()])
        self.seen.add_(1)
        if self.read_back:
            y = y + self.m2.to(d)
        return y.float()


def names(tape: object) -> tuple[list[str], list[str]]:
    from fusekit.torch.tape import _name

    got = [_name(e) for e in tape.entries]
    return got[:tape.fwd_end], got[tape.fwd_end:]


def test_casts_and_buffer_updates_replay_merged_into_foreach_launches():
    torch.manual_seed(0)
    (tape,) = same_training(Mixed(), batches(8, (4, 6))).forward.tapes.values()
    fwd, bwd = names(tape)
    assert fwd[0] == "aten._to_copy x5 (one foreach copy)", fwd  # the input and 4 parameters, at the start
    assert fwd[-2:] == ["aten._foreach_copy_ x2 (one foreach copy)", "aten.add_ x1 (one foreach add)"], fwd
    assert not [n for n in fwd if n.startswith(("aten._foreach_copy_.", "aten.add_.", "aten.detach."))], fwd
    assert fwd.count("aten._to_copy.default") == 3  # casts of values the forward made stay in place
    assert fwd.count("aten.detach (the tensor it aliases)") >= 2
    assert bwd[-1] == "aten._to_copy x4 (one foreach copy)", bwd  # the 4 gradients back to float32, at the end
    assert bwd.count("aten._to_copy.default") == 1  # the upstream gradient to float64: later ops read it
    # the forward's casts write into buffers kept across replays; the gradients' casts leave: new each time
    assert tape.bufs[0] is not None and len(tape.bufs[0]) == 5 and tape.bufs[-1] is None, tape.bufs
    assert {tape.buffers[b][2] for b in tape.bufs[0]} == {torch.float64}


def test_a_replay_keeps_its_forward_casts_in_buffers_across_steps():
    """The buffers of the forward's casts are the same memory on every replay, and each replay
    writes the input and the parameters of that step into them."""
    torch.manual_seed(0)
    replay = same_training(Mixed(), batches(8, (4, 6)))
    (tape,) = replay.forward.tapes.values()
    before = [t.data_ptr() for t in tape.pool]
    x, y = batches(9, (4, 6))[-1]
    F.cross_entropy(replay(x), y).backward()
    assert [t.data_ptr() for t in tape.pool] == before
    want = [x, replay.l1.weight, replay.l1.bias, replay.l2.weight, replay.l2.bias]  # in the order the forward casts them
    assert all(torch.equal(tape.pool[b], t.detach().double()) for b, t in zip(tape.bufs[0], want))


def test_a_buffer_read_after_its_update_keeps_its_place():
    torch.manual_seed(0)
    (tape,) = same_training(Mixed(read_back=True), batches(8, (4, 6))).forward.tapes.values()
    fwd, _ = names(tape)
    assert "aten._foreach_copy_ x1 (one foreach copy)" in fwd  # m1's update moves, m2's stays before its read
    assert "aten._foreach_copy_.default" in fwd and fwd.index("aten._foreach_copy_.default") < fwd.index("aten.add.Tensor")


class DetachRestride(Net):
    """A detach of a tensor that is then restrided in place: the detach keeps the old shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = super().forward(x) * 1
        keep = t.detach()
        t.as_strided_(t.shape[::-1], (1, t.shape[1]))
        return t.t() + keep


def test_a_detach_of_a_tensor_restrided_later_is_replayed_as_a_detach():
    torch.manual_seed(0)
    (tape,) = same_training(DetachRestride(), batches(6)).forward.tapes.values()
    assert "aten.detach.default" in names(tape)[0]


class ExpOut(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).exp() * 0.1  # exp's backward reads its result


class ExpLast(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).exp()  # the result itself is read by the backward


def test_a_result_the_backward_reads_reaches_it():
    torch.manual_seed(0)
    assert not next(iter(same_training(ExpOut(), batches(6)).forward.tapes.values())).out_read
    (tape,) = same_training(ExpLast(), batches(6)).forward.tapes.values()
    assert tape.out_read


def test_the_caller_may_change_a_result_the_backward_does_not_read():
    torch.manual_seed(0)
    model = Net()
    replay = ft.replayed(copy.deepcopy(model))
    for m in (model, replay):
        for x, y in batches(6):
            out = m(x)
            out.mul_(2)  # in place, after the forward
            F.cross_entropy(out, y).backward()
    assert replay.forward.replays == 2
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(replay.parameters(), model.parameters()))


def test_an_input_of_another_shape_gets_its_own_tape():
    torch.manual_seed(0)
    data = [b for pair in zip(batches(6), batches(6, (2, 3, 8, 8))) for b in pair]
    replay = same_training(Net(), data)
    assert len(replay.forward.tapes) == 2 and replay.forward.replays == 4


def test_input_gradients_flow_through_a_replay():
    torch.manual_seed(0)
    model = Net()
    replay = ft.replayed(copy.deepcopy(model))
    for _ in range(5):
        x = torch.randn(2, 3, 8, 8)
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        for m, xx in zip((model, replay), xs):
            m(xx).square().sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad)
    assert replay.forward.replays == 1


def test_eval_and_no_grad_calls_run_as_modules():
    torch.manual_seed(0)
    replay = ft.replayed(Net())
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(6):
            replay(x)
    replay.eval()
    for _ in range(6):
        replay(x)
    assert not replay.forward.calls and not replay.forward.tapes


class HostRead(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if y.sum().item() > -1e9 else y


class InPlace(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.mul_(1.0))


class Pair(Net):
    def forward(self, x: torch.Tensor) -> tuple:
        y = super().forward(x)
        return y, y


class Alternating(Net):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Alternating.calls += 1
        y = super().forward(x)
        return y + 1 if Alternating.calls % 2 else y * 2


@pytest.mark.parametrize("cls, why", [(HostRead, "reads a device value on the host"),
                                      (Pair, "returned tuple"),
                                      (Alternating, "4 recordings differ")])
def test_what_cannot_replay_runs_as_modules_with_a_warning(cls, why):
    torch.manual_seed(0)
    model = cls()
    replay = copy.deepcopy(model)
    ft.replayed(replay)
    data = batches(10)
    for m in (model, replay):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in data:
                out = m(x)
                loss = F.cross_entropy(out[0] if isinstance(out, tuple) else out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert replay.forward.replays == 0 and not replay.forward.tapes
    assert any("fusekit.torch.replayed" in str(w.message) and why in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), replay.state_dict().values()))


def test_an_in_place_write_to_the_input_is_not_recorded():
    torch.manual_seed(0)
    replay = ft.replayed(InPlace())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            replay(torch.randn(2, 3, 8, 8)).sum().backward()
    assert not replay.forward.tapes
    assert any("writes its input or a parameter in place" in str(w.message) for w in caught)


def test_moving_the_model_records_again():
    torch.manual_seed(0)
    model = Net()
    replay = same_training(model, batches(6))
    assert replay.forward.tapes
    replay.double()
    model.double()
    data = [(x.double(), y) for x, y in batches(6)]
    assert train(replay, data)[0] == train(model, data)[0]
    (tape,) = replay.forward.tapes.values()
    assert tape.consts == {} or all(t.dtype != torch.float32 for t in tape.consts.values())


def test_a_replay_backward_runs_once():
    torch.manual_seed(0)
    replay = ft.replayed(Net())
    x = torch.randn(2, 3, 8, 8)
    for _ in range(4):
        replay(x).sum().backward()
    loss = replay(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_copies_and_pickles_record_their_own():
    torch.manual_seed(0)
    replay = same_training(Net(), batches(6))
    for other in (copy.deepcopy(replay), pickle.loads(pickle.dumps(replay))):
        assert not other.forward.tapes
        assert other.forward.model is other
        twin = copy.deepcopy(other)
        assert train(other, batches(6))[0] == train(twin, batches(6))[0]
        assert other.forward.replays == twin.forward.replays == 2


def test_turned_off_it_runs_as_modules():
    torch.manual_seed(0)
    replay = ft.replayed(Net())
    replay.forward.enabled = False
    for x, y in batches(6):
        F.cross_entropy(replay(x), y).backward()
    assert not replay.forward.calls


def test_bad_arguments_raise_operand_errors():
    with pytest.raises(OperandError, match="'model': expected a torch.nn.Module"):
        ft.replayed(lambda x: x)
    for name, value in (("warmup", 0), ("max_tapes", True), ("warmup", 1.5)):
        with pytest.raises(OperandError, match=f"'{name}': expected an int >= 1"):
            ft.replayed(Net(), **{name: value})
    hooked = Net()
    hooked.c1.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(OperandError, match=r"hooks registered on it \(c1\)"):
        ft.replayed(hooked)



def test_replayed_or_graphed_take_over_from_a_replayed_model():
    """convert's default route is replayed: replayed again (new options) or graphed unwrap it first,
    and the class's own forward comes back when the wrapper goes."""
    from fusekit.torch.graphs import GraphedForward
    from fusekit.torch.replay import ReplayedForward

    m = ft.replayed(Net())
    first = m.forward
    again = ft.replayed(m, warmup=3)
    assert again is m and isinstance(m.forward, ReplayedForward) and m.forward is not first and m.forward.warmup == 3
    assert m.forward.original.__func__ is Net.forward  # the class's forward, not the old wrapper
    g = ft.graphed(m)
    assert g is m and isinstance(m.__dict__["forward"], GraphedForward)
    with pytest.raises(OperandError, match="'model': is graphed already"):
        ft.replayed(m)


def test_clearing_dispatch_records_again_and_a_plan_eviction_does_not(fresh_session):
    from fusekit import dispatch

    torch.manual_seed(0)
    replay = same_training(Net(), batches(6))
    gen = fresh_session.generation
    calls.drop_plan(fresh_session, object())  # a plan leaving the cache: calls holding it still run it
    assert fresh_session.generation == gen
    train(replay, batches(1))
    assert replay.forward.replays == 3
    dispatch.clear_dispatch()
    assert fresh_session.generation == gen + 1
    train(replay, batches(4))
    assert replay.forward.replays == 3 and replay.forward.calls, "tapes recorded before the clear were replayed"
    train(replay, batches(1))
    assert replay.forward.replays == 4


def test_gradient_accumulation_over_micro_batches():
    """Two replayed forwards, then one backward of their summed losses, into kept (zeroed) .grad."""
    torch.manual_seed(0)
    model = Net()
    replay = ft.replayed(copy.deepcopy(model))
    data = batches(12)
    for m in (model, replay):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for (x1, y1), (x2, y2) in zip(data[::2], data[1::2]):
            opt.zero_grad(set_to_none=False)
            (F.cross_entropy(m(x1), y1) + F.cross_entropy(m(x2), y2)).backward()
            opt.step()
    assert replay.forward.replays == 8
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), replay.state_dict().values()))


class Dropped(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(x), 0.5, self.training)


def test_random_ops_draw_afresh_on_each_replay():
    """Dropout replays draw new masks from the generator, in the order the modules would."""
    torch.manual_seed(0)
    model = Dropped()
    replay = ft.replayed(copy.deepcopy(model))
    data = batches(6)
    torch.manual_seed(1)
    want = train(model, data)
    torch.manual_seed(1)
    got = train(replay, data)
    assert replay.forward.replays == 2
    assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    x = data[0][0]
    assert not torch.equal(replay(x), replay(x)), "two replays drew the same mask"


def test_a_backward_after_dispatch_was_cleared_refuses_to_run_stale_calls():
    from fusekit import dispatch

    torch.manual_seed(0)
    replay = same_training(Net(), batches(6))
    loss = replay(batches(1)[0][0]).sum()
    assert replay.forward.replays == 3
    dispatch.clear_dispatch()
    with pytest.raises(RuntimeError, match="dispatch was cleared .* between a replayed forward and its backward"):
        loss.backward()


# fusekit calls in a tape, with stand-in calls (dispatch.execute.launch patched to run a torch function per
# call, as test_cpu_tapes does): recorded through the call recorder, replayed through launch.
MUL = call("mul", lambda a, b: (a * b,))
MUL_INTO = call("mul_into", lambda a, b, out: out[0].copy_(a * b))


class _ScaleFn(torch.autograd.Function):
    """y = x * w through stand-in fusekit calls; the backward writes dw into an output it was given."""

    @staticmethod
    def forward(ctx, x, w):  # noqa: ANN001
        from fusekit import dispatch

        ctx.save_for_backward(x, w)
        return record.run_call(MUL, (x, w), (), True)[0]

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        from fusekit import dispatch

        x, w = ctx.saved_tensors
        gw = torch.empty_like(x)
        record.run_call(MUL_INTO, (g, x), (gw,), False)
        return record.run_call(MUL, (g, w), (), True)[0], gw.sum(0)


class Scaled(Net):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(5) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleFn.apply(super().forward(x), self.w)


def test_fusekit_calls_in_a_tape_replay_through_launch(monkeypatch):
    from fusekit import dispatch

    launched: list = []
    monkeypatch.setattr(execute, "launch", launcher(launched))
    torch.manual_seed(0)
    replay = same_training(Scaled(), batches(6))
    assert replay.forward.replays == 2
    assert launched.count("mul") == 2 * 2 * 6 and launched.count("mul_into") == 2 * 6  # both models, every step
    (tape,) = replay.forward.tapes.values()
    calls = [e for e in tape.entries if e[0] == 1]
    assert [e[1].name for e in calls] == ["mul", "mul_into", "mul"]
    assert calls[1][3] is not None and calls[0][3] is None, "a given output is recorded as such, an allocated one as new"


class Chain(Net):
    """Three stand-in fusekit scalings after the Net: their forward outputs are saved for the
    backward, the backward's are read once."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.rand(5) + 0.5) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        for w in self.ws:
            y = _ScaleFn.apply(y, w)
        return y


def logging_launcher(log: list):
    """launcher() that also notes whether each call was given its outputs."""
    run = launcher([])

    def launch(c, operands, outs, alloc):  # noqa: ANN001
        log.append((c.name, alloc))
        return run(c, operands, outs, alloc)

    return launch


def test_replays_write_fusekit_outputs_into_kept_buffers(monkeypatch):
    from fusekit import dispatch

    log: list = []
    monkeypatch.setattr(execute, "launch", logging_launcher(log))
    torch.manual_seed(0)
    replay = same_training(Chain(), batches(8))
    (tape,) = replay.forward.tapes.values()
    pooled = [(i, b) for i, b in enumerate(tape.bufs) if b]
    made = {s for i, _ in pooled for s in tape.entries[i][4]}
    assert len(pooled) == 5, tape.bufs  # 2 forward outputs saved for the backward, the backward's 3
    assert tape.out not in made and not made & set(tape.grads), "the result and the gradients are new each time"
    # each backward output takes the buffer of a tensor read for the last time before it
    assert len(tape.buffers) == 2
    buffer = {s: b for i, ids in pooled for s, b in zip(tape.entries[i][4], ids)}
    for i, ids in pooled:  # never the buffer of a tensor the call reads
        assert not {buffer.get(s) for s in tape.reads(tape.entries[i])} & set(ids), (i, ids)
    steps = [log[i:i + 9] for i in range(len(log) - 9, 0, -9)][:2]  # the last two steps: 3 + 3 mul, 3 mul_into
    assert all(sum(name == "mul" and not alloc for name, alloc in step) == 5 for step in steps), steps
    assert tape.pool is not None and not tape.lent


def test_two_replays_in_flight_do_not_share_buffers(monkeypatch):
    """Two forwards, then one backward of both (micro-batches summed): the second replay allocates."""
    from fusekit import dispatch

    monkeypatch.setattr(execute, "launch", launcher([]))
    torch.manual_seed(0)
    model = Chain()
    replay = ft.replayed(copy.deepcopy(model))
    data = batches(6)
    for x, y in data[:4]:  # warm-up and recordings
        F.cross_entropy(replay(x), y).backward()
        F.cross_entropy(model(x), y).backward()
    (x1, y1), (x2, y2) = data[4:]
    for m in (model, replay):
        m.zero_grad()
        (F.cross_entropy(m(x1), y1) + F.cross_entropy(m(x2), y2)).backward()
    assert replay.forward.replays == 2
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(replay.parameters(), model.parameters()))
    (tape,) = replay.forward.tapes.values()
    assert not tape.lent


def test_one_input_shape_keeps_its_buffers_at_a_time(monkeypatch):
    from fusekit import dispatch

    monkeypatch.setattr(execute, "launch", launcher([]))
    torch.manual_seed(0)
    data = [b for pair in zip(batches(6), batches(6, (2, 3, 8, 8))) for b in pair]
    replay = same_training(Chain(), data)
    tapes = list(replay.forward.tapes.values())
    assert len(tapes) == 2 and all(t.buffers for t in tapes)
    assert [t.pool is not None for t in tapes] == [False, True]  # the last shape's


def test_a_replay_without_backward_gives_its_buffers_back(monkeypatch):
    from fusekit import dispatch

    monkeypatch.setattr(execute, "launch", launcher([]))
    torch.manual_seed(0)
    replay = same_training(Chain(), batches(6))
    (tape,) = replay.forward.tapes.values()
    out = replay(batches(1)[0][0])
    assert tape.lent
    del out
    assert not tape.lent


def test_a_call_resolved_again_between_recordings_still_agrees(monkeypatch):
    """A plan evicted and rebuilt gives a new resolved call with the same plan key: the recordings
    agree (and replay); a call of another plan key makes them differ."""
    import types

    from fusekit import dispatch

    monkeypatch.setattr(execute, "launch", launcher([]))
    global MUL
    original = MUL

    def fresh(key):
        return types.SimpleNamespace(name="mul", fn=original.fn, into=False, plan=types.SimpleNamespace(key=key))

    torch.manual_seed(0)
    model = ft.replayed(Scaled())
    try:
        for i, (x, y) in enumerate(batches(6)):
            MUL = fresh("mul-key")  # resolved again before every step
            F.cross_entropy(model(x), y).backward()
        assert model.forward.replays == 2
        model = ft.replayed(Scaled())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, (x, y) in enumerate(batches(8)):
                MUL = fresh(f"key-{i}")  # another plan every step
                F.cross_entropy(model(x), y).backward()
        assert model.forward.replays == 0
        assert any("op " in str(w.message) and "fusekit graph" in str(w.message) for w in caught), [str(w.message) for w in caught]
    finally:
        MUL = original


def test_convert_takes_the_replayed_route_by_default_and_says_so():
    """The obvious call gets the fast path: convert returns the model replayed (route in the report);
    route='modules' gives the plain modules; a model with hooks, which a replay would skip, keeps them."""
    from fusekit.torch.replay import ReplayedForward

    fast, report = ft.convert(Net())
    assert report.route == "replayed" and isinstance(fast.__dict__["forward"], ReplayedForward)
    assert "route: replayed" in str(report)
    plain, report = ft.convert(Net(), route="modules")
    assert report.route == "modules" and "forward" not in plain.__dict__ and "route: modules" in str(report)
    hooked = Net()
    hooked.c1.register_forward_hook(lambda m, a, o: None)
    kept, report = ft.convert(hooked)
    assert report.route.startswith("modules (") and "hooks" in report.route and "forward" not in kept.__dict__
    with pytest.raises(OperandError, match="'route': expected 'replayed' or 'modules'"):
        ft.convert(Net(), route="graphs")
