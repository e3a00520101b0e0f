"""The fast training step, by behaviour (timings are the benchmarks' business): no read-back of a
number from the device on a step that is not logged, the next batch read ahead exactly as the
step would read it, `compile: true` wired and refused where it cannot work, the fused or
foreach AdamW, and the run's timing rows."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.data.buckets import epoch_batches
from kit.errors import ConfigError
from kit.optim import adamw_kernel
from kit.run import checkpoint as ckpt
from kit.train import loop, step
from kit.train.log import TIMING_FILE
from kit.train.prefetch import Prefetcher
from kit.train.prepare import prepare
from kit.train.step import batch_generator, check_compile, micro_step

# Caption variants make each batch draw from its stream before loading: the case the
# prefetcher must get right.
VARIANTS = {"caption_shuffle": True, "caption_variants": 3}


@pytest.fixture()
def prepared(make_config, tmp_path):
    """A prepared tiny run with three caption variants per sample."""
    return prepare(load_config(make_config(output_dir=str(tmp_path / "run"), **VARIANTS)))


class Reads:
    """Counts every read of a tensor's value back to the host (`item`, `float`, `tolist`,
    `bool`), except the caption-variant draw's: it reads the CPU generator's own draw, never
    the device's work."""

    HOST_DRAWS = ("draw_variants",)

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.where: list[str] = []
        for name in ("item", "__float__", "tolist", "__bool__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    @property
    def count(self) -> int:
        return len(self.where)

    def _counted(self, original):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_name not in self.HOST_DRAWS:
                self.where.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)

        return counted


def test_micro_step_reads_nothing_back(prepared, monkeypatch):
    """A micro-step returns its loss and gradient norm as tensors and never waits for them."""
    s = prepared
    batches = epoch_batches(s.data.plan, s.cfg.train.train_batch_size, s.cfg.train.seed, 0)
    micro_step(s, batches[0], 0)  # first calls may set up lazily; the next must not read
    reads = Reads(monkeypatch)
    loss, norm = micro_step(s, batches[1], 1)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    assert isinstance(norm, torch.Tensor)
    assert reads.count == 0, reads.where
    # The numbers of a logged step come from one read.
    got, got_norm = step.step_numbers(s.accelerator, [loss], norm)
    assert reads.count <= 2 and got == float(loss) and got_norm == float(norm)


def test_prefetched_batches_are_the_direct_ones(prepared):
    """Two epochs read ahead give the batches read directly, in the same order; the global RNG
    and the batch's own stream are untouched; a prefetcher started mid-epoch (a resume) reads
    the same batch there."""
    s, t = prepared, prepared.cfg.train
    assert s.data.variants == 3
    ahead = Prefetcher(s.data, t.seed)
    order = [
        (epoch, i, b)
        for epoch in (0, 1)
        for i, b in enumerate(epoch_batches(s.data.plan, t.train_batch_size, t.seed, epoch))
    ]
    ahead.ahead(*order[0])
    try:
        for n, (epoch, i, indices) in enumerate(order):
            if n + 1 < len(order):
                ahead.ahead(*order[n + 1])
            rng = torch.get_rng_state()
            generator = batch_generator(t.seed, epoch, i)
            variants = s.data.draw_variants(len(indices), generator)
            after_draw = generator.get_state()
            got = ahead.take(epoch, i, indices, variants)
            assert torch.equal(generator.get_state(), after_draw)  # the stream is the step's
            torch.set_rng_state(rng)
            want = s.data.load_batch(indices, variants)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), (epoch, i)
        assert ahead.hits == len(order)
    finally:
        ahead.close()
    # Resumed at batch 3 of epoch 1: a fresh prefetcher, the same batch.
    epoch, i, indices = order[len(order) // 2 + 3]
    fresh = Prefetcher(s.data, t.seed)
    fresh.ahead(epoch, i, indices)
    variants = s.data.draw_variants(len(indices), batch_generator(t.seed, epoch, i))
    got = fresh.take(epoch, i, indices, variants)
    fresh.close()
    want = s.data.load_batch(indices, variants)
    assert fresh.hits == 1 and all(torch.equal(got[k], want[k]) for k in want)
    # A batch asked for with other variants than were drawn ahead is read again, as asked.
    other = [(v + 1) % 3 for v in variants]
    fresh = Prefetcher(s.data, t.seed)
    fresh.ahead(epoch, i, indices)
    again = fresh.take(epoch, i, indices, other)
    fresh.close()
    assert fresh.hits == 0
    want = s.data.load_batch(indices, other)
    assert all(torch.equal(again[k], want[k]) for k in want)


def _adapter(run_dir, step_):
    return load_file(str(ckpt.checkpoint_dir(run_dir, step_) / ckpt.ADAPTER_FILE))


def test_unlogged_steps_do_not_sync_and_prefetch_changes_nothing(
    make_config, tmp_path, monkeypatch
):
    """logging_steps 2 of 3 steps: numbers are read on steps 2 and 3 only, and only they are
    logged; the weights are bitwise those of a run without the read-ahead; the run log has the
    timing rows of its first step, final sample, doctor, archive and plot."""
    common = {"max_train_steps": 3, "checkpointing_steps": 0, "logging_steps": 2, **VARIANTS}
    synced: list[int] = []
    original = loop.step_numbers

    def counted(acc, losses, grad_norm):
        synced.append(len(losses))
        return original(acc, losses, grad_norm)

    monkeypatch.setattr(loop, "step_numbers", counted)
    made: list[Prefetcher] = []

    class ReadAhead(Prefetcher):
        """Reads ahead as on a GPU (the loop turns it off on a CPU, see below)."""

        def __init__(self, data, seed, enabled=True):
            made.append(self)
            assert enabled is False, "on a CPU the loop asks for no read-ahead"
            super().__init__(data, seed, enabled=True)

    monkeypatch.setattr(loop, "Prefetcher", ReadAhead)
    a = tmp_path / "a"
    events: list[dict] = []
    loop.train(
        load_config(make_config("a.json", output_dir=str(a), **common)), callbacks=[events.append]
    )
    assert synced == [1, 1]
    rows = [json.loads(x) for x in (a / "logs/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]
    assert [e["step"] for e in events if e["kind"] == "step"] == [2, 3]
    timing = [json.loads(x) for x in (a / "logs" / TIMING_FILE).read_text().splitlines()]
    phases = [r["phase"] for r in timing]
    for phase in ("first_step", "final_sample", "doctor", "archive", "plot"):
        assert phase in phases, phases
    assert all(r["kind"] == "timing" and r["seconds"] >= 0 for r in timing)
    first = next(r for r in timing if r["phase"] == "first_step")
    assert first["warmup_seconds"] == pytest.approx(
        max(first["seconds"] - first["later_step_seconds"], 0), abs=2e-3
    )

    assert made and made[0].hits > 0, "the run was to read ahead"

    class NoReadAhead(Prefetcher):
        def __init__(self, data, seed, enabled=True):
            super().__init__(data, seed, enabled=False)

    monkeypatch.setattr(loop, "Prefetcher", NoReadAhead)
    b = tmp_path / "b"
    loop.train(load_config(make_config("b.json", output_dir=str(b), **common)))
    wa, wb = _adapter(a, 3), _adapter(b, 3)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_compile_true_compiles_the_denoiser_and_reports_the_warm_up(
    make_config, tmp_path, monkeypatch, capsys
):
    """`compile: true` compiles the denoiser in place before training and says what the first
    step cost. Dynamo's `eager` backend stands in for inductor here: the wiring, the in-place
    compile (names unchanged, checkpoint written) and the report are what is tested; inductor
    itself compiles for minutes on a small CPU."""
    compiled = []

    def eager(denoiser, **options):
        compiled.append(type(denoiser).__name__)
        return step.compile_denoiser(denoiser, backend="eager")

    monkeypatch.setattr("kit.train.prepare.compile_denoiser", eager)
    out = tmp_path / "run"
    cfg = load_config(
        make_config(output_dir=str(out), compile=True, max_train_steps=3, checkpointing_steps=0)
    )
    result = loop.train(cfg)
    assert result.step == 3 and compiled == ["UNet2DConditionModel"]
    assert "compile: the first step took" in capsys.readouterr().out
    weights = _adapter(out, 3)
    assert weights and not any("_orig_mod" in k for k in weights)


def test_compile_is_refused_where_it_cannot_work(monkeypatch):
    with pytest.raises(ConfigError, match="blocks_to_swap 2"):
        check_compile(True, 2, False, "cpu")
    with pytest.raises(ConfigError, match="DeepSpeed"):
        check_compile(True, 0, True, "cuda")
    monkeypatch.setattr(step.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        check_compile(True, 0, False, "cpu")
    check_compile(False, 2, True, "cpu")  # off: nothing to refuse


def test_adamw_kernel_is_fused_where_the_device_has_it():
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert adamw_kernel(cpu) == {"fused": True}
    assert adamw_kernel([{"params": cpu, "lr": 1e-3}]) == {"fused": True}
    assert adamw_kernel([torch.nn.Parameter(torch.zeros(2, device="meta"))]) == {}
    assert adamw_kernel([]) == {}
