"""Where a GPU training step's time goes, in one call of about 3 minutes: a prepared check that tells the
causes of the host-bound step apart (the review behind issue 50, GPU-31efa24.md). `benchmarks/gpu_check.sh`
runs it first; alone: `python benchmarks/gpu_diagnose.py` from the repository root (aiayn importable).

Phases (each prints one line; the last line is one JSON object; full tables go to $OUT if set):
  P0  versions, and the SDPA backend the dispatcher picks for each attention kind, by PyTorch's default and
      under aiayn's policy (`sdpa_backends`: no cuDNN attention)
      (torch._fused_sdp_choice on training-shaped bf16 tensors): CUDNN_ATTENTION means every new batch
      shape builds cuDNN graphs (aten/src/ATen/native/cudnn/MHA.cpp caches them by exact shape).
  A1  bare loop (no Lightning, no loader), model=base, bf16 autocast, fused Adam, ONE batch repeated:
      host enqueue ms per step (no sync) against GPU ms per step (CUDA events, pipelined) -> is the
      eager step host-bound even at a fixed shape?
  A2  40 batches of new shapes, default SDPA, synchronised per step: pass 1 (new) and pass 2 (seen);
      cudaMalloc calls per step (memory_stats num_device_alloc), Python gen-2 GC ms.
  A3  the same with cuDNN SDPA off (torch.backends.cuda.enable_cudnn_sdp(False)), on other new shapes.
      A2p1 - A3p1 = cuDNN graph builds; A3p1 - A3p2 = allocator growth and other first-shape costs.
  A4  bare loop pipelined (one sync at the end) over seen shapes, cuDNN SDPA off: the bare tokens/s
      that aiayn-train should approach.
  A5  torch.profiler over 3 static steps: GPU busy ms per step (sum of kernel times) and the top host
      ops; over 2 new-shape steps with default SDPA: the host time inside the SDPA ops.
  A6  greedy decoding (as validations translate) of 2 new batch shapes, default SDPA against cuDNN off:
      every decoder step has a new key length, so a cuDNN default builds a graph per step.
  B   aiayn-train itself (Lightning, callbacks, the 2-worker loader) with TORCH_CUDNN_SDPA_DEPRIORITIZED=1,
      through benchmarks/gpu_bench.py's training(): tokens/s and host seconds per step by part. Skipped
      when too little time is left.
Usage: python benchmarks/gpu_diagnose.py [--deadline 200] [--skip-lightning] [--device cpu --tiny (a smoke
test of the control flow only)]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from aiayn.data.dataset import Collator  # noqa: E402
from aiayn.data.sampler import TokenBudgetBatchSampler  # noqa: E402
from aiayn.model import TransformerConfig, batch_training_flops, use_sdpa_backends  # noqa: E402
from aiayn.training.module import TranslationModule  # noqa: E402
from aiayn.training.schedule import OptimSettings  # noqa: E402

PAD, BOS, EOS = 0, 2, 3
START = time.perf_counter()
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None


def left(deadline: float) -> float:
    return deadline - (time.perf_counter() - START)


def say(phase: str, result: dict[str, Any]) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {phase}: {json.dumps(result)}", flush=True)


# -- batches shaped like the training pipeline's ------------------------------------------------------
def batch_sets(vocab: int, max_tokens: int, count: int, sets: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """``sets`` disjoint lists of ``count`` batches from the project's sampler and collator over 60000 random
    pairs of 7-60 tokens (target about the source's length): the shapes vary as in a real epoch."""
    rng = np.random.default_rng(seed)
    n = 60_000
    src_len = rng.integers(7, 61, size=n)
    tgt_len = np.clip((src_len * rng.uniform(0.8, 1.25, size=n)).astype(int), 5, 80)
    pairs = [
        (i, rng.integers(4, vocab, size=s).astype(np.uint16), rng.integers(4, vocab, size=t).astype(np.uint16))
        for i, (s, t) in enumerate(zip(src_len, tgt_len, strict=True))
    ]
    sizes = np.stack([src_len + 1, tgt_len + 1], axis=1)
    sampler = TokenBudgetBatchSampler(sizes, max_tokens, seed=seed, shuffle=True)
    collate = Collator(PAD, BOS, EOS)
    order = list(sampler)
    out = []
    for k in range(sets):
        chosen = order[k * count : (k + 1) * count]
        out.append([collate([pairs[i] for i in batch]) for batch in chosen])
    return out


def pinned(batches: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    return [
        {k: (v.pin_memory() if isinstance(v, torch.Tensor) and device.type == "cuda" else v) for k, v in b.items()}
        for b in batches
    ]


# -- the bare step ------------------------------------------------------------------------------------
class Bare:
    """TranslationModule's training loss, backward and fused Adam, plus what the guard and the EMA add
    per step (a gradient norm, flags, a foreach lerp), under bf16 autocast on CUDA."""

    def __init__(self, cfg: TransformerConfig, device: torch.device) -> None:
        torch.manual_seed(0)
        self.module = TranslationModule(
            cfg, BOS, EOS, optim=OptimSettings(label_smoothing=0.2, schedule="linear", lr=1e-3, warmup=400)
        ).to(device)
        self.module.train()
        self.optimizer = self.module.configure_optimizers()["optimizer"]
        self.params = list(self.module.parameters())
        self.ema = [p.detach().clone().float() for p in self.params]
        self.device = device
        self.cfg = cfg

    def step(self, batch: dict[str, Any]) -> None:
        b = {k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        ctx = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        with ctx:
            loss, _ = self.module.training_loss(b)
        loss.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        self.optimizer.found_inf = torch.stack([~torch.isfinite(loss.detach()), ~torch.isfinite(norm)]).float().amax()
        self.optimizer.step()
        del self.optimizer.found_inf
        torch._foreach_lerp_(self.ema, [p.detach() for p in self.params], 0.005)
        self.optimizer.zero_grad(set_to_none=True)

    def flops(self, batch: dict[str, Any]) -> float:
        lengths = torch.from_numpy(batch["lengths"])
        return batch_training_flops(self.cfg, lengths[:, 0], lengths[:, 1])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_allocs(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_device_alloc", stats.get("segment.all.allocated", 0)))


@contextlib.contextmanager
def gc_timer() -> Iterator[dict[str, float]]:
    """Seconds spent in Python's generation-2 collections while inside."""
    acc = {"gen2_ms": 0.0, "gen2_count": 0}
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            acc["gen2_ms"] += 1000 * (time.perf_counter() - started.pop())
            acc["gen2_count"] += 1

    gc.callbacks.append(callback)
    try:
        yield acc
    finally:
        gc.callbacks.remove(callback)


def synced_steps(bare: Bare, batches: list[dict[str, Any]], deadline: float) -> dict[str, Any]:
    """Each step timed alone (synchronised), with the cudaMalloc calls it made."""
    times, allocs = [], []
    with gc_timer() as gcs:
        for batch in batches:
            if left(deadline) < 30:
                break
            before = device_allocs(bare.device)
            start = time.perf_counter()
            bare.step(batch)
            sync(bare.device)
            times.append(time.perf_counter() - start)
            allocs.append(device_allocs(bare.device) - before)
    return {
        "steps": len(times),
        "ms_median": round(1000 * statistics.median(times), 1) if times else None,
        "ms_p90": round(1000 * sorted(times)[int(0.9 * (len(times) - 1))], 1) if times else None,
        "ms_max": round(1000 * max(times), 1) if times else None,
        "cudamallocs_per_step": round(sum(allocs) / max(len(allocs), 1), 2),
        **{k: round(v, 1) for k, v in gcs.items()},
    }


def pipelined(bare: Bare, batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps enqueued back to back, one sync at the end: host enqueue ms/step, wall ms/step, tokens/s."""
    sync(bare.device)
    enqueue = []
    start = time.perf_counter()
    if bare.device.type == "cuda":
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
    for batch in batches:
        t0 = time.perf_counter()
        bare.step(batch)
        enqueue.append(time.perf_counter() - t0)
    if bare.device.type == "cuda":
        last.record()
    sync(bare.device)
    wall = time.perf_counter() - start
    tokens = sum(int(b["lengths"].sum()) for b in batches)
    flops = sum(bare.flops(b) for b in batches)
    out = {
        "steps": len(batches),
        "host_enqueue_ms_median": round(1000 * statistics.median(enqueue), 1),
        "wall_ms_per_step": round(1000 * wall / len(batches), 1),
        "tokens_per_s": round(tokens / wall),
        "model_tflops_per_s": round(flops / wall / 1e12, 1),
    }
    if bare.device.type == "cuda":
        out["gpu_event_ms_per_step"] = round(first.elapsed_time(last) / len(batches), 1)
    return out


def sdpa_choices(bare: Bare, batch: dict[str, Any]) -> dict[str, str]:
    """The backend F.scaled_dot_product_attention picks by default for each attention of a training step."""
    from torch.nn.attention import SDPBackend

    names = {int(v): k for k, v in SDPBackend.__members__.items()}
    d = bare.device
    B, S = batch["src"].shape
    T = batch["tgt_in"].shape[1]
    h, dk = bare.cfg.n_heads, bare.cfg.d_k
    dt = torch.bfloat16 if d.type == "cuda" else torch.float32

    def heads(n: int, fused: int) -> torch.Tensor:  # a view into a fused projection, as the model makes
        x = torch.randn(B, n, fused * h * dk, device=d, dtype=dt, requires_grad=True)
        return x[..., : h * dk].unflatten(-1, (h, dk)).transpose(1, 2)

    pad = batch["src"].to(d).eq(PAD)
    bias = torch.zeros(B, 1, 1, S, device=d, dtype=dt).masked_fill(pad[:, None, None, :], float("-inf"))
    cases = {
        "encoder_self(mask)": (heads(S, 3), heads(S, 3), heads(S, 3), bias, False),
        "decoder_self(causal)": (heads(T, 3), heads(T, 3), heads(T, 3), None, True),
        "cross(mask)": (heads(T, 1), heads(S, 2), heads(S, 2), bias, False),
    }
    out = {}
    for name, (q, k, v, mask, causal) in cases.items():
        try:
            out[name] = names.get(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal)), "?")
        except Exception as error:
            out[name] = f"error: {type(error).__name__}: {str(error)[:80]}"
    return out


def profiled(bare: Bare, batches: list[dict[str, Any]]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bare.device.type == "cuda" else [])
    sync(bare.device)
    with profile(activities=activities) as prof:
        for batch in batches:
            bare.step(batch)
        sync(bare.device)
    events = prof.key_averages()
    # kernels and copies are the events on the device; summing the ops' device times too would count twice
    busy_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events if str(e.device_type).endswith("CUDA"))
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    sdpa = {
        e.key: round(e.cpu_time_total / 1000 / len(batches), 2)
        for e in events
        if "scaled_dot_product" in e.key
        or "efficient_attention" in e.key
        or "flash_attention" in e.key
        or "cudnn_attention" in e.key
    }
    runtime = {
        e.key: e.count
        for e in events
        if e.key
        in (
            "cudaMalloc",
            "cudaFree",
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaHostAlloc",
            "cudaLaunchKernel",
            "cuLaunchKernel",
            "cudaMemcpyAsync",
        )
    }
    if OUT is not None:
        (OUT / f"profile_{len(batches)}steps_{int(time.perf_counter())}.txt").write_text(
            events.table(sort_by="self_cpu_time_total", row_limit=40)
        )
    return {
        "gpu_busy_ms_per_step": round(busy_us / 1000 / len(batches), 2),
        "top_host_ops_ms_per_step": [(e.key, round(e.self_cpu_time_total / 1000 / len(batches), 2)) for e in host],
        "sdpa_ops_ms_per_step": sdpa,
        "runtime_calls_per_step": {k: round(v / len(batches), 1) for k, v in runtime.items()},
    }


def decoding(bare: Bare, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """Greedy decoding (as the validations of a fit translate) of random sources of these (rows, length):
    each decoder step has a new key length, so with cuDNN SDPA each step of a new shape builds a graph."""
    from aiayn.model import DecodingOptions, translate_ids

    model = bare.module.model
    model.eval()
    times = []
    try:
        for rows, length in shapes:
            src = torch.randint(4, bare.cfg.vocab_size, (rows, length), device=bare.device)
            ctx = (
                torch.autocast(bare.device.type, dtype=torch.bfloat16)
                if bare.device.type == "cuda"
                else contextlib.nullcontext()
            )
            sync(bare.device)
            start = time.perf_counter()
            with torch.no_grad(), ctx:
                translate_ids(model, src, BOS, EOS, DecodingOptions(beam_size=1, max_len_offset=10))
            sync(bare.device)
            times.append(round(time.perf_counter() - start, 2))
    finally:
        model.train()
    return {"seconds_per_batch": times, "shapes": shapes}


def lightning(deadline: float) -> dict[str, Any]:
    """aiayn-train with cuDNN SDPA deprioritised, through gpu_bench.training (Lightning's simple profiler):
    190 steps at most (the generated corpus makes 198 batches an epoch at 25000 tokens; gpu_bench validates
    after max_steps, which must fit in an epoch), within the time left."""
    import gpu_bench

    budget = int(min(100, left(deadline) - 10))
    if budget < 60:
        return {"skipped": f"{left(deadline):.0f} s left"}
    gpu_bench.TIMEOUTS["train"] = budget  # it trains for budget - 40 s, then validates
    os.environ["TORCH_CUDNN_SDPA_DEPRIORITIZED"] = "1"
    folder = Path(tempfile.mkdtemp(prefix="aiayn-diagnose-"))
    try:
        return gpu_bench.timed_out(lambda: gpu_bench.training(folder, "base", 190, "train"), "train")
    finally:
        os.environ.pop("TORCH_CUDNN_SDPA_DEPRIORITIZED", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=200.0, help="seconds for the whole check")
    parser.add_argument("--skip-lightning", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batches (smoke test on a CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke test on a shared machine: no OpenMP oversubscription
    result: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        result |= {
            "gpu": torch.cuda.get_device_name(0),
            "cudnn": torch.backends.cudnn.version(),
            "sdp_enabled": {
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            },
            "env_TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        }
    vocab = 5000
    if args.tiny:
        cfg = TransformerConfig(vocab_size=vocab, d_model=64, d_ff=128, n_heads=8, d_k=8, d_v=8)
        max_tokens, count = 600, 6
    else:
        cfg = TransformerConfig(vocab_size=vocab)  # model=base
        max_tokens, count = 25000, 40
    sets = batch_sets(vocab, max_tokens, count, 3)
    sets = [pinned(s, device) for s in sets]
    shapes = [{(b["src"].shape[0], b["src"].shape[1], b["tgt_in"].shape[1]) for b in s} for s in sets]
    result["batches"] = {
        "per_set": count,
        "distinct_shapes_per_set": [len(s) for s in shapes],
        "real_tokens_per_batch_median": statistics.median(int(b["lengths"].sum()) for b in sets[0]),
    }
    bare = Bare(cfg, device)
    say("setup", result["batches"])

    result["P0_default_sdpa_backend"] = sdpa_choices(bare, sets[0][0])
    say("P0", result["P0_default_sdpa_backend"])
    flags = {
        name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
        for name in ("cudnn", "flash", "mem_efficient", "math")
    }
    use_sdpa_backends()  # what aiayn-train, -eval and -translate set (sdpa_backends' default)
    result["P0_aiayn_sdpa_backend"] = sdpa_choices(bare, sets[0][0])
    say("P0 aiayn", result["P0_aiayn_sdpa_backend"])
    for name, enabled in flags.items():  # the phases below compare PyTorch's default with cuDNN off themselves
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)

    static = sets[0][0]
    for _ in range(5):
        bare.step(static)
    result["A1_static_shape_pipelined"] = pipelined(bare, [static] * (20 if not args.tiny else 4))
    say("A1", result["A1_static_shape_pipelined"])

    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["A2_new_shapes_default_sdpa_pass1"] = synced_steps(bare, sets[0], args.deadline)
    say("A2 pass1", result["A2_new_shapes_default_sdpa_pass1"])
    result["A2_seen_shapes_default_sdpa_pass2"] = synced_steps(bare, sets[0], args.deadline)
    say("A2 pass2", result["A2_seen_shapes_default_sdpa_pass2"])

    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["A3_new_shapes_no_cudnn_pass1"] = synced_steps(bare, sets[1], args.deadline)
    say("A3 pass1", result["A3_new_shapes_no_cudnn_pass1"])
    result["A3_seen_shapes_no_cudnn_pass2"] = synced_steps(bare, sets[1], args.deadline)
    say("A3 pass2", result["A3_seen_shapes_no_cudnn_pass2"])

    result["A4_seen_shapes_no_cudnn_pipelined"] = pipelined(bare, sets[1])
    say("A4", result["A4_seen_shapes_no_cudnn_pipelined"])

    if left(args.deadline) > 20:
        result["A5_profile_static_no_cudnn"] = profiled(bare, [static] * 3)
        say("A5 static", result["A5_profile_static_no_cudnn"])
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    if left(args.deadline) > 20:
        result["A5_profile_new_shapes_default_sdpa"] = profiled(bare, sets[2][:2])
        say("A5 new shapes", result["A5_profile_new_shapes_default_sdpa"])

    # A6: greedy decoding of new shapes, default SDPA, then with cuDNN SDPA off (other new shapes)
    if left(args.deadline) > 30:
        result["A6_greedy_decode_default_sdpa"] = decoding(bare, [(64, 30), (48, 25)])
        torch.backends.cuda.enable_cudnn_sdp(False)
        result["A6_greedy_decode_no_cudnn"] = decoding(bare, [(60, 28), (44, 22)])
        torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
        say(
            "A6",
            {k: result[k]["seconds_per_batch"] for k in ("A6_greedy_decode_default_sdpa", "A6_greedy_decode_no_cudnn")},
        )

    if not args.skip_lightning and not args.tiny and device.type == "cuda":
        result["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        del bare
        gc.collect()
        torch.cuda.empty_cache()  # the training subprocess gets the card to itself
        result["B_aiayn_train_cudnn_sdpa_deprioritised"] = lightning(args.deadline)
        say("B", result["B_aiayn_train_cudnn_sdpa_deprioritised"])

    result["verdict"] = verdict(result)
    result["wall_s"] = round(time.perf_counter() - START, 1)
    if OUT is not None:
        (OUT / "gpu_diagnose.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    """The numbers that decide between the causes (docs/reviews/GPU-31efa24.md, "Reading the check")."""

    def get(*path: str) -> Any:
        node: Any = r
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    a1, a2, a2b = (
        get("A1_static_shape_pipelined"),
        get("A2_new_shapes_default_sdpa_pass1"),
        get("A2_seen_shapes_default_sdpa_pass2"),
    )
    a3, a3b, a4 = (
        get("A3_new_shapes_no_cudnn_pass1"),
        get("A3_seen_shapes_no_cudnn_pass2"),
        get("A4_seen_shapes_no_cudnn_pipelined"),
    )
    out: dict[str, Any] = {}
    choices = get("P0_default_sdpa_backend") or {}
    out["cudnn_sdpa_is_default"] = any("CUDNN" in str(v) for v in choices.values())
    if a2 and a3 and a2["ms_median"] and a3["ms_median"]:
        out["cudnn_graph_build_ms_per_new_shape_step"] = round(a2["ms_median"] - a3["ms_median"], 1)
    if a2 and a2b and a2["ms_median"] and a2b["ms_median"]:
        out["default_sdpa_new_over_seen_shapes"] = round(a2["ms_median"] / a2b["ms_median"], 2)
    if a3 and a3b and a3["ms_median"] and a3b["ms_median"]:
        out["other_first_shape_ms_per_step"] = round(a3["ms_median"] - a3b["ms_median"], 1)
        out["cudamallocs_per_step_new_vs_seen"] = (a3["cudamallocs_per_step"], a3b["cudamallocs_per_step"])
    if a1 and "gpu_event_ms_per_step" in a1:
        busy = get("A5_profile_static_no_cudnn", "gpu_busy_ms_per_step")
        out["static_host_enqueue_ms"] = a1["host_enqueue_ms_median"]
        out["static_gpu_busy_ms"] = busy
        out["eager_host_bound_at_fixed_shape"] = bool(busy and a1["host_enqueue_ms_median"] > 0.8 * busy)
    if a4:
        out["bare_tokens_per_s"] = a4["tokens_per_s"]
    dec, dec_off = get("A6_greedy_decode_default_sdpa"), get("A6_greedy_decode_no_cudnn")
    if dec and dec_off:
        out["greedy_decode_s_default_vs_no_cudnn"] = (
            round(sum(dec["seconds_per_batch"]), 2),
            round(sum(dec_off["seconds_per_batch"]), 2),
        )
    b = get("B_aiayn_train_cudnn_sdpa_deprioritised")
    if isinstance(b, dict) and b.get("tokens_per_s_later_half") and a4:
        out["aiayn_train_over_bare"] = round(b["tokens_per_s_later_half"] / a4["tokens_per_s"], 3)
    return out


if __name__ == "__main__":
    main()
