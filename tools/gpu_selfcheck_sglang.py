"""The SGLang row of `gpu_selfcheck.py`: start a server (SGLang's own, or the stand-in with
`module=`) on a model directory (or a tiny random Qwen3 saved here), wait for health, and
check one `/generate` round trip in token ids.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from gpu_selfcheck import Row, free_port

def _http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def make_tiny_model(out_dir: str) -> str:
    """Save a tiny random-weight Qwen3 (config.json + safetensors, no tokenizer) to `out_dir`.

    Lets the SGLang round trip run on machines without access to a model hub: the server is
    started with --skip-tokenizer-init and spoken to in token ids.
    Returns:
        out_dir.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, eos_token_id=1,
                      bos_token_id=0, tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def check_sglang(model_dir: str | None, timeout_s: float,
                 module: str = "sglang.launch_server") -> Row:
    """Launch `python -m sglang.launch_server` on GPU 0, wait for /health, POST /generate.

    Args:
        model_dir: Hugging Face model directory; "tiny" builds a tiny random Qwen3 in a
            temporary directory; None: skipped.
        timeout_s: limit for the server to become healthy.
        module: server module taking SGLang's launch flags (SGLang's by default).
    """
    name = "sglang server round trip"
    if module.startswith("sglang.") and importlib.util.find_spec("sglang") is None:
        return Row(name, "skipped: sglang not installed")
    if not model_dir:
        return Row(name, "skipped: pass --sglang-model DIR (or tiny)")
    if model_dir == "tiny":
        with tempfile.TemporaryDirectory(prefix="tiny_qwen3_") as tmp:
            return check_sglang(make_tiny_model(tmp), timeout_s, module)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return Row(name, "FAIL", f"--sglang-model {model_dir}: no config.json there")
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="sglang_selfcheck_", suffix=".log")
    argv = [sys.executable, "-m", module, "--model-path", model_dir,
            "--host", "127.0.0.1", "--port", str(port), "--tp-size", "1",
            "--mem-fraction-static", "0.3", "--random-seed", "0"]
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        argv.append("--skip-tokenizer-init")  # token ids in and out
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    row = _sglang_round_trip(proc, f"http://127.0.0.1:{port}", log_path, timeout_s)
    if row.status == "ok":
        os.unlink(log_path)  # kept only when it explains a failure
    return row


def _sglang_round_trip(proc: subprocess.Popen, base: str, log: str, timeout_s: float) -> Row:
    """Wait for the launched server, send one /generate, stop the server's process group."""
    name = "sglang server round trip"
    try:
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                return Row(name, "FAIL", f"server exited with {proc.returncode}; log: {log}")
            try:
                if _http(base + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return Row(name, "FAIL", f"not healthy after {timeout_s:.0f}s; log: {log}")
            time.sleep(2)
        startup = time.monotonic() - t0
        n_new = 16
        # Token ids rather than text: valid for any vocabulary, no tokenizer round trip needed.
        body = {"input_ids": list(range(10, 18)),
                "sampling_params": {"max_new_tokens": n_new, "temperature": 0.0,
                                    "ignore_eos": True},
                "return_logprob": True}
        t1 = time.monotonic()
        status, raw = _http(base + "/generate", body, timeout=120)
        gen = time.monotonic() - t1
        if status != 200:
            return Row(name, "FAIL", f"/generate answered HTTP {status}: {raw[:120]!r}")
        out = json.loads(raw)
        meta = out.get("meta_info", {})
        logprobs = meta.get("output_token_logprobs") or []
        decoded = isinstance(out.get("text"), str) or isinstance(out.get("output_ids"), list)
        ok = decoded and meta.get("completion_tokens") == n_new and len(logprobs) == n_new
        detail = (f"up in {startup:.0f}s, {meta.get('completion_tokens')} tokens "
                  f"+ {len(logprobs)} logprobs in {gen * 1e3:.0f} ms")
        return Row(name, "ok" if ok else "FAIL", detail if ok else f"{detail}; answer: {out}"[:200])
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


# ----------------------------------------------------------------------------- report

