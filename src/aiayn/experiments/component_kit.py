"""The component test kit: one call that puts a component (a built-in or a user's class) through what the
model, training, decoding, checkpoints and export ask of it.

``check_component("attention", {"_target_": "my_package.MyAttention", ...})`` builds a small Transformer
with the component in its place (in float64, dropout off, so that equal means equal) and checks:

- ``shapes``: teacher-forced logits (B, T, vocab) and encoder states (B, S, d_model);
- ``padding``: a sentence's logits are the same alone and in a batch padded to a longer one (the
  padding masks are respected: what sits at masked positions changes nothing);
- ``causal``: changing later target tokens changes no earlier position's logits;
- ``cache``: incremental decoding with the key/value cache, and after beam search reorders its rows,
  gives the logits of recomputing the whole prefix;
- ``positions`` (attention): the two checks above also hold under T5's bias and RoPE's rotation, and the
  encoder tells word order apart under each (an attention that ignores ``positions`` fails);
- ``determinism``: the same seed builds the same weights; two passes give the same output;
- ``gradients``: a training step's gradients are finite and reach the component's own parameters;
- ``resume``: training 3 steps, saving model and Adam state (``weights_only`` load, as checkpoints are
  read), loading into a fresh model and training 3 more equals 6 steps uninterrupted, bit for bit, and
  the checkpoint loader's shape check accepts the state dict;
- ``flops``: :func:`aiayn.model.forward_flops` (the MFU numerator) equals torch's FLOP counter when the
  class counts itself (a class without ``flops`` is counted as the paper's component: a note);
- ``export``: each ``aiayn-export`` format takes the component (in the kit's own model) or refuses it in
  one line naming its setting.

A failure is reported by name with its reason; :class:`ComponentCheckError` carries them all.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from aiayn.config.components import trust
from aiayn.errors import FieldError, first_line
from aiayn.export.folder import FORMATS, check_exportable
from aiayn.model import PositionalEncoding, Transformer, TransformerConfig, forward_flops, register_component
from aiayn.model.components import KINDS, component_class, is_built_in, spec_parts, target_of
from aiayn.model.weights import check_weights

# A model of seconds: every code path of the full one (two layers a stack, several heads, padding).
KIT_MODEL = {"vocab_size": 40, "n_layers": 2, "d_model": 32, "d_ff": 48, "n_heads": 4, "d_k": 8, "d_v": 8}
KIT_MODEL |= {"dropout": 0.0, "max_positions": 64, "pad_id": 0}
TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}  # float64


class ComponentCheckError(AssertionError):
    """The kit's failures, each ``<check>: <reason>`` on a line of its own."""

    def __init__(self, report: KitReport) -> None:
        self.report = report
        lines = [f"{name}: {reason}" for name, reason in report.failed.items()]
        super().__init__(f"{report.component} fails {len(lines)} of the kit's checks:\n" + "\n".join(lines))


@dataclass
class KitReport:
    component: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def check_component(kind: str, spec: Mapping[str, Any] | type, model: Mapping[str, Any] | None = None) -> KitReport:
    """Put the ``kind`` component through every check of the kit, in a kit-sized model (or one with the
    settings ``model`` gives instead); raise :class:`ComponentCheckError` listing the failures, else
    return the report. ``spec`` is a spec (``{_target_: my_package.MyAttention, scale: 10}``) or the class
    itself; the class it names is imported and trusted in this process, as your config naming it would."""
    if kind not in KINDS:
        raise FieldError("kind", kind, f"must be one of {', '.join(KINDS)}")
    if isinstance(spec, type):
        register_component(spec)
        spec = {"_target_": target_of(spec)}
    target, _ = spec_parts(kind, spec)
    if not is_built_in(kind, target):
        trust(f"{kind}._target_", target)
    cfg = TransformerConfig(**{**KIT_MODEL, **(model or {}), kind: dict(spec)})
    report = KitReport(f"{kind}={target}")
    checks: dict[str, Callable[[TransformerConfig, KitReport], None]] = {
        "shapes": _shapes,
        "padding": _padding,
        "causal": _causal,
        "cache": _cache,
        "positions": lambda c, r: _positions(c, r, kind),
        "determinism": _determinism,
        "gradients": lambda c, r: _gradients(c, r, kind),
        "resume": _resume,
        "flops": lambda c, r: _flops(c, r, kind, target),
        "export": lambda c, r: _export(TransformerConfig(**{**KIT_MODEL, kind: dict(spec)}), r, kind),
    }
    for name, check in checks.items():
        try:
            check(cfg, report)
        except Exception as error:  # whatever the component raises is the finding
            report.failed[name] = f"{type(error).__name__}: {first_line(error)}"
        else:
            report.passed.append(name)
    if report.failed:
        raise ComponentCheckError(report)
    return report


def _model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).double().eval()


def _tokens(*rows: list[int]) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows])


SOURCE = ([5, 9, 13, 7, 21, 3, 2], [6, 11, 4, 2])  # a long and a short sentence (2 = EOS)
TARGET = ([1, 8, 17, 12, 30, 9], [1, 14, 6])  # each starts with BOS (1)


def _shapes(cfg: TransformerConfig, report: KitReport) -> None:
    model = _model(cfg)
    src, tgt = _tokens(*SOURCE), _tokens(*TARGET)
    memory, _ = model.encode(src)
    assert memory.shape == (2, src.size(1), cfg.d_model), f"encoder states {tuple(memory.shape)}"
    logits = model(src, tgt)
    assert logits.shape == (2, tgt.size(1), cfg.vocab_size), f"logits {tuple(logits.shape)}"
    assert torch.isfinite(logits).all(), "logits are not finite"


def _padding(cfg: TransformerConfig, report: KitReport) -> None:
    model = _model(cfg)
    batched = model(_tokens(*SOURCE), _tokens(*TARGET))[1, : len(TARGET[1])]
    alone = model(_tokens(SOURCE[1]), _tokens(TARGET[1]))[0]
    torch.testing.assert_close(batched, alone, **TOLERANCE, msg="a padded sentence's logits differ from its own")


def _causal(cfg: TransformerConfig, report: KitReport) -> None:
    model = _model(cfg)
    src, tgt = _tokens(*SOURCE), _tokens(*TARGET)
    changed = tgt.clone()
    changed[:, 3:] = 25
    torch.testing.assert_close(
        model(src, tgt)[:, :3], model(src, changed)[:, :3], **TOLERANCE, msg="later target tokens change earlier logits"
    )


def _cache(cfg: TransformerConfig, report: KitReport) -> None:
    model = _model(cfg)
    src, tgt = _tokens(*SOURCE), _tokens(*TARGET)
    full = model(src, tgt)
    memory, padding = model.encode(src)
    state = model.init_state()
    for t in range(3):
        step = model.decode(tgt[:, t : t + 1], memory, padding, state)[:, 0]
        torch.testing.assert_close(step, full[:, t], **TOLERANCE, msg=f"cached decoding differs at step {t}")
    order = torch.tensor([1, 0])  # beam search reorders the rows of every cache
    state.select(order)
    memory, padding = memory.index_select(0, order), padding.index_select(0, order)
    swapped = tgt.index_select(0, order)
    step = model.decode(swapped[:, 3:4], memory, padding, state)[:, 0]
    expected = model(src.index_select(0, order), swapped)[:, 3]
    torch.testing.assert_close(step, expected, **TOLERANCE, msg="cached decoding differs after reordering rows")


def _positions(cfg: TransformerConfig, report: KitReport, kind: str) -> None:
    """An attention under positions that act inside it (T5's bias, RoPE's rotation): padding and cached
    decoding still hold, and the encoder tells word order apart (reversing the source does not merely
    reverse its states)."""
    if kind != "attention":
        return
    for positional in ("t5", "rope"):
        placed = replace(cfg, positional=positional)
        _padding(placed, report)
        _cache(placed, report)
        model = _model(placed)
        src = _tokens(SOURCE[0])
        forward, _ = model.encode(src)
        backward, _ = model.encode(src.flip(1))
        assert not torch.allclose(forward, backward.flip(1)), f"the attention ignores positional={positional}"


def _determinism(cfg: TransformerConfig, report: KitReport) -> None:
    first, second = _model(cfg, seed=3), _model(cfg, seed=3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"the same seed builds {name} differently"
    src, tgt = _tokens(*SOURCE), _tokens(*TARGET)
    assert torch.equal(first(src, tgt), first(src, tgt)), "two passes give different logits"


def _owned(model: Transformer, kind: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of the ``kind`` components in ``model``."""
    marker = {"attention": ("self_attn", "cross_attn"), "feed_forward": ("ffn",), "norm": ("norm",)}.get(kind)
    return [
        (name, param)
        for name, param in model.named_parameters()
        if (name.startswith("positions.") if marker is None else any(part in marker for part in name.split(".")))
    ]


def _loss(model: Transformer) -> torch.Tensor:
    src, tgt = _tokens(*SOURCE), _tokens(*TARGET)
    logits = model(src, tgt)
    gold = torch.roll(tgt, -1, dims=1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=0)


def _gradients(cfg: TransformerConfig, report: KitReport, kind: str) -> None:
    model = _model(cfg).train()
    _loss(model).backward()
    for name, param in model.named_parameters():
        assert param.grad is None or torch.isfinite(param.grad).all(), f"the gradient of {name} is not finite"
    owned = _owned(model, kind)
    if not owned:
        report.notes.append("gradients: the component has no parameters of its own")
    for name, param in owned:
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"


def _train(model: Transformer, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        _loss(model).backward()
        optimizer.step()


def _optimizer(model: Transformer) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)  # §5.3


def _resume(cfg: TransformerConfig, report: KitReport) -> None:
    straight = _model(cfg).train()
    optimizer = _optimizer(straight)
    _train(straight, optimizer, 6)
    first = _model(cfg).train()
    optimizer = _optimizer(first)
    _train(first, optimizer, 3)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    check_weights(replace(cfg), {name: tensor.float() for name, tensor in saved["model"].items()})
    resumed = _model(cfg, seed=1).train()
    resumed.load_state_dict(saved["model"])
    optimizer = _optimizer(resumed)
    optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, optimizer, 3)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after save and resume"


def _flops(cfg: TransformerConfig, report: KitReport, kind: str, target: str) -> None:
    inherited = (PositionalEncoding, object)  # the base's flops counts no positional work: not the class's own
    counts_itself = any("flops" in vars(c) for c in component_class(kind, target).__mro__ if c not in inherited)
    model = _model(cfg)
    src, tgt = _tokens(SOURCE[0]), _tokens(TARGET[0])
    # The math kernel is made of the products the counter sees; CPU FlashAttention is not counted by it.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(src, tgt)
    counted, analytic = counter.get_total_flops(), forward_flops(cfg, src.size(1), tgt.size(1))
    if counts_itself:
        assert analytic == counted, f"forward_flops counts {analytic}, torch's FLOP counter {counted}"
    elif analytic != counted:
        report.notes.append(
            f"flops: counted as the paper's {kind} ({analytic} FLOPs a kit pass, torch counts {counted}); "
            "define a static flops(...) to count it for MFU"
        )


def _export(cfg: TransformerConfig, report: KitReport, kind: str) -> None:
    for target in FORMATS:
        try:
            check_exportable(cfg, target)
        except FieldError as error:
            message = str(error)
            assert "\n" not in message, f"format={target}'s refusal is not one line: {message!r}"
            assert message.startswith(f"{kind}"), f"format={target}'s refusal names another setting: {message}"
            report.notes.append(f"export: {message}")
