"""Lion, CAME and schedule-free AdamW: the settings they get, the state the estimator counts,
and schedule-free's two sets of weights (the averaged ones are evaluated, saved and resumed)."""

from __future__ import annotations

import json

import pytest
import torch
from came_pytorch import CAME
from lion_pytorch import Lion
from safetensors.torch import load_file
from schedulefree import AdamWScheduleFree
from torch import nn

from kit.config import TrainConfig, load_config
from kit.errors import ConfigError
from kit.optim import check_optimizer, eval_weights, make_optimizer, make_scheduler
from kit.preflight.trace import OPTIMIZERS, optimizer_bytes
from kit.run import checkpoint as ckpt
from kit.train.loop import fit, train
from kit.train.prepare import prepare

NEW = ("lion", "came", "schedulefree")
SETTINGS = {"learning_rate": 3e-3, "adam_weight_decay": 0.05, "lr_warmup_steps": 2}


def _module() -> nn.Module:
    """Weights of every kind an optimizer treats apart: a matrix, a conv kernel, vectors."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Conv2d(8, 4, 3), nn.LayerNorm(4))


def _steps(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], n: int = 3) -> None:
    """`n` steps on the same fixed gradients, whatever the optimizer."""
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


# What each optimizer should be, built from its package by hand: the kit's settings mapped as
# its docstring says (Lion and CAME keep their papers' betas; schedule-free warms up itself).
REFERENCE = {
    "lion": lambda ps: Lion(ps, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05),
    "came": lambda ps: CAME(
        ps, lr=3e-3, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16), weight_decay=0.05
    ),
    "schedulefree": lambda ps: AdamWScheduleFree(
        ps, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, warmup_steps=2
    ),
}


@pytest.mark.parametrize("name", NEW)
def test_each_optimizer_steps_as_its_package_does(name):
    ours, theirs = _module(), _module()
    mine = make_optimizer(list(ours.parameters()), TrainConfig(optimizer=name, **SETTINGS))
    ref = REFERENCE[name](list(theirs.parameters()))
    if name == "schedulefree":
        ref.train()
    before = [p.detach().clone() for p in ours.parameters()]
    _steps(mine, list(ours.parameters()))
    _steps(ref, list(theirs.parameters()))
    for a, b, c in zip(ours.parameters(), theirs.parameters(), before, strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


def test_lion_moves_each_weight_by_the_learning_rate():
    """Lion's first step from zero momentum: decay, then minus lr times the gradient's sign."""
    m = _module()
    p0 = [p.detach().clone() for p in m.parameters()]
    opt = make_optimizer(list(m.parameters()), TrainConfig(optimizer="lion", **SETTINGS))
    _steps(opt, list(m.parameters()), n=1)
    for p, w in zip(m.parameters(), p0, strict=True):
        want = w * (1 - 3e-3 * 0.05) - 3e-3 * p.grad.sign()
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", NEW)
def test_the_estimator_counts_each_optimizers_state(name):
    """The bytes the estimator models are the bytes the optimizer holds after a step."""
    m = _module()
    params = list(m.parameters())
    opt = make_optimizer(params, TrainConfig(optimizer=name, **SETTINGS))
    _steps(opt, params, n=1)
    held = sum(
        v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    assert optimizer_bytes([tuple(p.shape) for p in params])[name]["state"] == held


def test_came_state_is_factored_for_matrices_and_whole_for_vectors():
    shapes = [(320, 640), (320,)]
    got = optimizer_bytes(shapes)
    # The momentum whole; rows and columns of the second moment and of the confidence; a full
    # second moment for the vector; an RMS scalar each.
    want = 4 * (320 * 640 + 320) + 4 * 2 * (320 + 640) + 4 * 320 + 4 * 2
    assert got["came"]["state"] == want
    assert got["lion"]["state"] == got["adamw"]["state"] // 2
    assert got["schedulefree"]["state"] == got["adamw"]["state"]
    assert set(OPTIMIZERS) == set(got)


@pytest.mark.parametrize("name", ["lion", "came", "schedulefree", "prodigy"])
def test_a_missing_package_names_what_to_install(name, monkeypatch):
    real = __import__("importlib.util").util.find_spec
    module = {"lion": "lion_pytorch", "came": "came_pytorch", "prodigy": "prodigyopt"}.get(
        name, name
    )
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda m, *a: None if m == module else real(m, *a)
    )
    package = {"lion": "lion-pytorch", "came": "came-pytorch", "prodigy": "prodigyopt"}.get(
        name, name
    )
    t = TrainConfig(optimizer=name)
    with pytest.raises(
        ConfigError, match=f"optimizer {name} needs {package}: pip install {package}$"
    ):
        check_optimizer(t, deepspeed=False)
    with pytest.raises(ConfigError, match=f"pip install {package}$"):
        make_optimizer(list(_module().parameters()), t)


def test_schedule_free_refuses_a_schedule_and_deepspeed():
    with pytest.raises(
        ConfigError, match="lr_scheduler: cosine with optimizer schedulefree, .*use constant"
    ):
        TrainConfig(optimizer="schedulefree", lr_scheduler="cosine")
    with pytest.raises(ConfigError, match="cannot run under DeepSpeed"):
        check_optimizer(TrainConfig(optimizer="schedulefree"), deepspeed=True)
    check_optimizer(TrainConfig(optimizer="lion"), deepspeed=True)  # Lion and CAME may


def test_textual_inversion_refuses_schedule_free(tiny_sd15):
    from kit.config import from_dict
    from kit.families import get_family
    from kit.methods import get_method
    from tests.conftest import TEXTUAL_INVERSION

    fields = {"pretrained_model": str(tiny_sd15), **TEXTUAL_INVERSION}
    cfg = from_dict({**fields, "optimizer": "schedulefree"})
    with pytest.raises(ConfigError, match="textual_inversion cannot train with optimizer sched"):
        get_method(cfg, get_family("sd15", cfg))
    get_method(from_dict({**fields, "optimizer": "lion"}), get_family("sd15", cfg))


def test_schedule_free_warms_up_itself_under_a_constant_schedule():
    """`constant_with_warmup` is accepted, and the warm-up happens once: in the optimizer."""
    t = TrainConfig(optimizer="schedulefree", lr_scheduler="constant_with_warmup", **SETTINGS)
    m = _module()
    opt = make_optimizer(list(m.parameters()), t)
    sched = make_scheduler(opt, t)
    rates = []
    for _ in range(3):
        _steps(opt, list(m.parameters()), n=1)
        sched.step()
        rates.append(opt.param_groups[0]["scheduled_lr"])
        assert opt.param_groups[0]["lr"] == 3e-3  # the schedule itself stays put
    assert rates == pytest.approx([1.5e-3, 3e-3, 3e-3])


def test_eval_weights_is_a_no_op_for_other_optimizers():
    m = _module()
    opt = make_optimizer(list(m.parameters()), TrainConfig(optimizer="lion", **SETTINGS))
    _steps(opt, list(m.parameters()), n=2)
    before = [p.detach().clone() for p in m.parameters()]
    with eval_weights(opt):
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), before, strict=True))


SCHEDULE_FREE_RUN = {
    "optimizer": "schedulefree",
    "lr_warmup_steps": 2,
    "max_train_steps": 4,
    "checkpointing_steps": 2,
    "ema_decay": 0.9,
}


@pytest.mark.slow
def test_schedule_free_checkpoints_hold_the_averaged_weights(tmp_path, make_config):
    """At a checkpoint the trained parameters are the optimizer's eval-mode average (x), not the
    point it takes gradients at (y). The next step trains in train mode again (the optimizer
    refuses to step in eval mode)."""
    box, seen = {}, {}

    def watch(event):
        s = box["s"]
        if event["kind"] == "step":
            seen[event["step"]] = {k: v.clone() for k, v in s.method.state_dict(s.comps).items()}
        if event["kind"] == "checkpoint" and event["step"] == 2:
            seen["train_mode"] = s.optimizer.param_groups[0]["train_mode"]
            seen["eval"] = {k: v.clone() for k, v in s.method.state_dict(s.comps).items()}
            s.optimizer.train()
            seen["train"] = {k: v.clone() for k, v in s.method.state_dict(s.comps).items()}
            s.optimizer.eval()

    cfg = load_config(make_config(**{**SCHEDULE_FREE_RUN, "max_train_steps": 3}))
    box["s"] = s = prepare(cfg, callbacks=[watch])
    fit(s)
    saved = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 2) / ckpt.ADAPTER_FILE))
    assert seen["train_mode"] is False
    assert all(torch.equal(saved[k], seen["eval"][k]) for k in saved)
    assert any(not torch.allclose(saved[k], seen["train"][k]) for k in saved)
    # The EMA averaged the same weights: after step 1 it is x1 (its decay warms up from 0),
    # then 2/11 of it and 9/11 of x2 (diffusers' EMAModel warm-up, (1 + n) / (10 + n)).
    ema = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 2) / ckpt.EMA_FILE))
    for k in ema:
        want = seen[1][k] * 2 / 11 + seen[2][k] * 9 / 11
        torch.testing.assert_close(ema[k], want, rtol=0, atol=1e-7)
    # After the last step the parameters stay on the average: what the final checkpoint holds.
    final = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 3) / ckpt.ADAPTER_FILE))
    now = s.method.state_dict(s.comps)
    assert s.optimizer.param_groups[0]["train_mode"] is False
    assert all(torch.equal(final[k], now[k]) for k in final)


@pytest.mark.slow
def test_schedule_free_resume_matches_the_straight_run(tmp_path, make_config):
    """Stopped at the step-2 checkpoint and resumed: the same weights, EMA and optimizer state
    at step 4 as a run that never stopped."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config(make_config("a.json", output_dir=str(a), **SCHEDULE_FREE_RUN)))
    cfg_b = load_config(make_config("b.json", output_dir=str(b), **SCHEDULE_FREE_RUN))

    def stop_at_2(event):
        if event["kind"] == "checkpoint" and event["step"] == 2:
            raise KeyboardInterrupt

    assert train(cfg_b, callbacks=[stop_at_2]).step == 2
    assert train(cfg_b, resume="latest").step == 4
    for name in (ckpt.ADAPTER_FILE, ckpt.EMA_FILE):
        wa = load_file(str(ckpt.checkpoint_dir(a, 4) / name))
        wb = load_file(str(ckpt.checkpoint_dir(b, 4) / name))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name
    oa, ob = (
        torch.load(ckpt.checkpoint_dir(r, 4) / ckpt.OPTIMIZER_FILE, weights_only=True)
        for r in (a, b)
    )
    assert oa["param_groups"][0]["k"] == ob["param_groups"][0]["k"] == 4
    for i, st in oa["state"].items():
        assert all(torch.equal(v, ob["state"][i][k]) for k, v in st.items())
    rows = [json.loads(x) for x in (b / "logs/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))
    # The log shows the optimizer's own warm-up (2 steps), not the constant schedule.
    assert [r["lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lion", "came"])
def test_lion_and_came_train_the_tiny_model(tmp_path, make_config, name):
    result = train(
        load_config(make_config(optimizer=name, max_train_steps=2, checkpointing_steps=0))
    )
    assert result.step == 2
    weights = load_file(str(result.checkpoint / ckpt.ADAPTER_FILE))
    # LoRA's up matrices start at zero: any that moved was trained.
    ups = [v for k, v in weights.items() if "lora_B" in k or "lora_up" in k]
    assert ups and any(v.abs().sum() > 0 for v in ups)


def test_the_estimate_and_advice_take_each_optimizer(tiny_sd15):
    """The estimate counts each optimizer's state on the real trained shapes; the advice starts
    from any of them."""
    from kit.config import from_dict
    from kit.preflight.advice import options
    from kit.preflight.estimate import estimate

    cfg = from_dict({"pretrained_model": str(tiny_sd15), "resolution": 64, "optimizer": "came"})
    state = {o: estimate(cfg, optimizer=o).components["optimizer_state"] for o in OPTIMIZERS}
    assert state["lion"] * 2 == state["adamw"] == state["schedulefree"]
    assert state["adamw"] / 2 < state["came"] < state["adamw"]  # a momentum, factored the rest
    tried = {o.value: o.cost for o in options(cfg, None)["optimizer"]}
    assert tried["came"] == 1.0 and tried["adafactor"] < tried["came"]  # costs relative to now
