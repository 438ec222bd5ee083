"""The servers under test of benchmarks/serve.py, each a process of its own, and the models they
serve (docs/serving.md, "Measured").

A server is `mod serve CKPT --host 127.0.0.1 --port 0 ...` (or, for `--profile`, the same
command under serve_profile.py's step profiler): its port is read from the line it prints once
it listens, it is ready when /health answers, and it stops on SIGTERM, which must end it with
exit status 0. Its torch threads are set through OMP_NUM_THREADS (`mod serve` has no flag).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
START_S = 300.0  # a server must listen within this (torch import and model load, busy CPU)
URL_LINE = re.compile(r"on (http://[^/\s]+)/v1")


@dataclass
class Server:
    name: str  # the configuration, "mod/continuous"
    proc: subprocess.Popen
    log: Path
    url: str = ""
    exit_code: int | None = None
    take_rate: dict[str, float] = field(default_factory=dict)


def serve_command(ckpt: str, name: str, args: argparse.Namespace) -> list[str]:
    """`mod serve`'s flags for configuration `name` ("mod/static": model, batching)."""
    kind, batching = name.split("/")
    cmd = [
        ckpt,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--model-name",
        kind,
        "--max-rows",
        str(args.max_rows),
        "--page-size",
        str(args.page_size),
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--batching",
        batching,
        "--max-queue",
        str(max(64, 2 * args.requests)),
        "--max-connections",
        str(max(256, 2 * args.requests + 16)),
        "--device",
        args.device,
        "--log-level",
        "warning",
    ]
    if args.kv_pages is not None:
        cmd += ["--kv-pages", str(args.kv_pages)]
    return cmd


def start(
    name: str, ckpt: str, args: argparse.Namespace, work: Path, profile_json: Path | None = None
) -> Server:
    """Start configuration `name`'s server on `ckpt` (not yet ready: see `wait_ready`)."""
    tag = f"{name.replace('/', '-')}-{time.monotonic_ns()}"
    log = work / f"{tag}.log"
    if profile_json is None:
        head = [sys.executable, "-m", "mixture_of_depths.cli", "serve"]
    else:
        head = [sys.executable, str(HERE / "serve_profile.py"), str(profile_json)]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            head + serve_command(ckpt, name, args), stdout=out, stderr=subprocess.STDOUT, env=env
        )
    return Server(name, proc, log)


def _tail(server: Server, n: int = 2000) -> str:
    return server.log.read_text(errors="replace")[-n:]


def wait_ready(server: Server, timeout_s: float = START_S) -> None:
    """The server's URL from its log, then a 200 from /health; bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not server.url:
        found = URL_LINE.search(server.log.read_text(errors="replace"))
        if found:
            server.url = found.group(1)
        elif server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}'s server did not start:\n{_tail(server)}")
        else:
            time.sleep(0.05)
    while True:
        try:
            if httpx.get(server.url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}'s server never answered /health:\n{_tail(server)}")
        time.sleep(0.05)


def read_take_rate(server: Server) -> None:
    """The share of decoded tokens that took each routed layer, over the server's life."""
    from mixture_of_depths.serve.metrics import parse_prometheus

    try:
        m = parse_prometheus(httpx.get(server.url + "/metrics", timeout=10.0).text)
    except httpx.HTTPError:
        return
    rates = m.get("mod_take_rate")
    server.take_rate = dict(rates) if isinstance(rates, dict) else {}


def stop(server: Server, grace_s: float = 60.0) -> int | None:
    """SIGTERM, then the exit status (0 after a drain); killed if it outlives the grace."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        server.exit_code = server.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10.0)
        server.exit_code = None
    if server.exit_code != 0:
        print(
            f"{server.name}'s server exited {server.exit_code}:\n{_tail(server)}", file=sys.stderr
        )
    return server.exit_code


def kill_all(servers: list[Server]) -> None:
    """The servers still running after an error: killed (ours only, by their Popen)."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10.0)


# -- the models --------------------------------------------------------------------------------
def untrained_checkpoints(preset: str, seed: int, work: Path) -> dict[str, str]:
    """The preset untrained as MoD (predictors calibrated so about the capacity takes each routed
    layer: an untrained predictor says "take" or "skip" for nearly every token) and its dense
    twin, saved as checkpoints for `mod serve` (speed does not depend on the weights)."""
    import torch

    from mixture_of_depths import MoDConfig, MoDTransformer
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.routing import calibrate_predictors
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    cfg = MoDConfig.preset(preset)
    if not cfg.routed_layers:
        raise SystemExit(f"--preset {preset} has no routed layer: give a MoD preset (small, base)")
    torch.manual_seed(seed)
    mod = MoDTransformer(cfg).eval()
    calib = torch.randint(
        0, min(cfg.vocab_size, 256), (8, 64), generator=torch.Generator().manual_seed(seed)
    )
    calibrate_predictors(mod, calib, cfg.capacity)
    torch.manual_seed(seed)
    dense = MoDTransformer(cfg.dense_twin()).eval()
    out = {}
    for name, model in (("mod", mod), ("dense", dense)):
        path = save_checkpoint(work / name, model, model.config, tokenizer=ByteTokenizer())
        out[name] = str(path)
    return out


def preset_of(ckpt: str) -> str | None:
    """The preset a checkpoint's shape is (d_model, n_layers, n_heads), for its target."""
    from mixture_of_depths.presets import PRESETS
    from mixture_of_depths.runtime.checkpoint import load_config

    cfg = load_config(ckpt)
    for name in ("small", "base", "tiny"):
        p = PRESETS[name]
        if (cfg.d_model, cfg.n_layers, cfg.n_heads) == (p["d_model"], p["n_layers"], p["n_heads"]):
            return name
    return None


def held_out_text(mod_dir: str, data: str | None) -> list[int]:
    """The validation tokens of the MoD checkpoint's run (or of `data`): prompts cut from them
    route as the model's text does; random ids would not."""
    from mixture_of_depths.data import load_splits, load_tokenizer
    from mixture_of_depths.runtime.checkpoint import read_json_file, resolve_checkpoint

    ckpt = resolve_checkpoint(mod_dir)
    if data is None and (ckpt / "trainer.json").exists():
        data = read_json_file(ckpt / "trainer.json").get("train_config", {}).get("data")
    return load_splits(data, load_tokenizer(ckpt))[1].tolist()


# -- the model's own decode ratio -----------------------------------------------------------------
def measure_model_ratio(
    mod_ckpt: str,
    batch_sizes: list[int],
    prompt_len: int,
    new_tokens: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """`bench.decode` on the served MoD checkpoint (its dense twin: the same shapes) at the
    server's batch sizes and mean context, in a process of its own: MoD / dense tokens/s."""
    cmd = [
        sys.executable,
        "-m",
        "mixture_of_depths.bench.decode",
        "--checkpoint",
        mod_ckpt,
        "--batch-sizes",
        ",".join(map(str, batch_sizes)),
        "--prompt-len",
        str(prompt_len),
        "--new-tokens",
        str(new_tokens),
        "--repeats",
        str(args.decode_repeats),
        "--warmup",
        "1",
        "--threads",
        str(args.threads),
        "--device",
        args.device,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the model's decode benchmark failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "source": f"bench.decode, prompt {prompt_len} + {new_tokens} tokens, this run",
        "ratios": {str(r["batch_size"]): r["speedup"] for r in out["ratios"]},
        "cpu_busy_others": out.get("cpu_busy_others"),
    }


def read_model_ratio(path: str) -> dict[str, Any]:
    """MoD / dense decode tokens/s per batch size from a `mod bench` JSON (its `decode`
    section) or a `benchmarks/decode.py` one: the file, or its last line that is JSON."""
    text = Path(path).read_text()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        lines = [ln for ln in text.strip().splitlines() if ln.startswith("{")]
        if not lines:
            raise SystemExit(f"--model-ratio {path}: no JSON line in it") from None
        obj = json.loads(lines[-1])
    decode = obj.get("decode", obj)
    if "ratios" not in decode:
        raise SystemExit(
            f"--model-ratio {path}: no decode ratios in it (mod bench --sections decode)"
        )
    ctx = f"prompt {decode.get('prompt_len')} + {decode.get('new_tokens')} tokens"
    return {
        "source": f"{path} ({ctx})",
        "ratios": {str(r["batch_size"]): r["speedup"] for r in decode["ratios"]},
        "cpu_busy_others": decode.get("cpu_busy_others"),
    }
