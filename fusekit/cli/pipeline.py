"""``fusekit pipeline``: compile an ONNX model into a fusekit pipeline and print its report, or
benchmark it against PyTorch."""

from __future__ import annotations

import click

from .common import DTYPES, Group

_DTYPES = click.Choice(list(DTYPES))


#: Upper bounds of --batch and --size: far beyond any GPU's memory for an image model, and refused
#: before a memory plan of exabytes is printed.
MAX_BATCH, MAX_SIZE = 65_536, 16_384


def _shape(model: str, batch: int, size: int | None) -> tuple[int, ...]:
    """The input shape: --batch for dim 0; --size for dynamic H, W (224 if not given). --size on a
    model whose H, W are fixed must agree with them."""
    from fusekit.pipeline.onnx_import import input_shape

    static = input_shape(model, batch=batch, default_hw=-1)  # -1: a dynamic dim
    if size is not None and any(d not in (-1, size) for d in static[2:]):
        raise click.UsageError(f"--size {size}: {model}'s input has fixed spatial dims {tuple(static[2:])}; omit --size")
    return tuple(static[:2]) + tuple((224 if size is None else size) if d == -1 else d for d in static[2:])


def _fail(e: Exception) -> click.ClickException:
    return click.ClickException(f"{type(e).__name__}: {e}")


@click.group("pipeline", cls=Group)
def pipeline() -> None:
    """Whole networks (ONNX) as fused fusekit calls replayed from one CUDA graph."""


@pipeline.command("compile")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), default=1, show_default=True, help="Batch size (the pipeline's fixed shape).")
@click.option("--dtype", type=_DTYPES, default="float16", show_default=True)
@click.option("--autotune", is_flag=True, help="Autotune every fused stage before the warm-up.")
@click.option("--size", type=click.IntRange(1, MAX_SIZE), default=None, help="Image size where the ONNX input is dynamic (default 224).")
@click.option("--no-gpu", is_flag=True, help="Only import and lower the model (CPU): print the stage table, fallbacks and memory plan.")
def compile_cmd(model: str, batch: int, dtype: str, autotune: bool, size: int | None, no_gpu: bool) -> None:
    """Compile MODEL.onnx and print the pipeline's report (stages, engines, times, fallbacks, memory)."""
    import fusekit.pipeline as fp
    from fusekit.errors import FusekitError, NoGPUError

    try:
        shape = _shape(model, batch, size)
        if no_gpu:
            pipe = fp.Pipeline(fp.lower_model(model, shape), dtype=dtype)
        elif autotune:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("autotune {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
                task = bar.add_task("", total=None)
                pipe = fp.compile(model, shape, dtype=dtype, autotune=True,
                                  progress=lambda done, total, what: bar.update(task, completed=done, total=total, description=what))
        else:
            pipe = fp.compile(model, shape, dtype=dtype)
    except NoGPUError as e:
        raise click.ClickException(f"{e}; pass --no-gpu to import and lower the model on the CPU") from None
    except (FusekitError, OSError, ValueError) as e:
        raise _fail(e) from None
    click.echo(pipe.report(), nl=False)


@pipeline.command("bench")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), default=1, show_default=True)
@click.option("--dtype", type=_DTYPES, default="float16", show_default=True)
@click.option("--size", type=click.IntRange(1, MAX_SIZE), default=None, help="Image size where the ONNX input is dynamic (default 224).")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Calls per timed trial.")
@click.option("--trials", type=click.IntRange(min=1), default=10, show_default=True, help="Trials (the median is reported).")
def bench_cmd(model: str, batch: int, dtype: str, size: int | None, iters: int, trials: int) -> None:
    """Time MODEL.onnx as a fusekit pipeline (graph replay) vs PyTorch running the same staged
    network (BN folded, channels-last), eagerly and captured in a CUDA graph."""
    import fusekit.pipeline as fp
    from fusekit.errors import FusekitError

    try:
        import torch
    except ImportError as e:
        raise click.ClickException(f"pipeline bench needs PyTorch ({e})") from None
    try:
        shape = _shape(model, batch, size)
        pipe = fp.compile(model, shape, dtype=dtype)
    except (FusekitError, OSError, ValueError) as e:
        raise _fail(e) from None
    from fusekit.pipeline.bench import TorchProgram, capture, cuda_time_ms

    x = torch.randn(shape, device=pipe.device).to(getattr(torch, dtype)).contiguous(memory_format=torch.channels_last)

    def fresh() -> None:
        x.normal_()
        pipe.input_buffer.copy_(x)

    fk = cuda_time_ms(lambda: pipe.run(x, clone=False), iters=iters, trials=trials, before_trial=fresh)
    tp = TorchProgram(pipe.program, dtype, pipe.device)
    with torch.no_grad():
        eager = cuda_time_ms(lambda: tp(x), iters=iters, trials=trials, before_trial=lambda: x.normal_())
        g = capture(lambda: tp(x))
        graph = cuda_time_ms(g.replay, iters=iters, trials=trials, before_trial=lambda: x.normal_())
    click.echo(f"model {model}  batch {batch}  {dtype} channels-last  input {shape}  ({torch.cuda.get_device_name(pipe.device)})")
    click.echo(f"fusekit pipeline (graph replay):   {fk:9.4f} ms")
    click.echo(f"PyTorch eager:                     {eager:9.4f} ms   ({eager / fk:.2f}x fusekit's time)")
    click.echo(f"PyTorch eager in a CUDA graph:     {graph:9.4f} ms   ({graph / fk:.2f}x fusekit's time)")
    if pipe.fallbacks:
        click.echo(f"fallbacks (PyTorch): {len(pipe.fallbacks)}")
