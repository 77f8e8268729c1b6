"""The weights and memory side of the stand-in SGLang server (`server.StandinServer` mixes it
in), as strict as SGLang 0.5.12: `/flush_cache`, `/update_weights_from_tensor` (every TP
rank's entry decoded with SGLang's unpickler allow-list; a bad entry or a wrong shape ends the
server as it ends SGLang's scheduler), `/update_weights_from_disk`, the distributed update
group (`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`), `/update_weight_version`, and `/release_memory_occupation` /
`/resume_memory_occupation` with SGLang's tags and refusals.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from aiohttp import web

from megatron_gspo.quant.blockfp8 import FP8_DTYPE
from megatron_gspo.rollout.engine import MEMORY_TAGS
from megatron_gspo.rollout.weight_sync_payloads import (
    decode_tensor_update,
    init_learner_update_group,
)
from megatron_gspo.rollout.served_shapes import stacked_part
from megatron_gspo.rollout.standin.draft import reaches_draft

#: Architectures whose SGLang 0.5.12 load_weights indexes params_dict with the fused name of a
#: stacked part without checking it (models/qwen3.py); llama.py, qwen2.py and qwen3_moe.py
#: skip such a name instead.
UNCHECKED_STACKED = ("Qwen3ForCausalLM",)


class WeightEndpoints:
    """Weight and memory endpoints; the server provides `engine`, `stats`, `released_tags`,
    `lost_weights`, `weight_version` and `weights_cpu_backup`."""

    def served_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of the served parameter `name` (None: the model has none): an FP8 model's
        `weight_scale_inv` parameters are its checkpoint's (fp8.py create_weights)."""
        shape = self.engine.param_shape(name)
        if shape is None and getattr(self, "fp8_rx", None) is not None:
            shape = self.fp8_scales.get(name)
        return shape

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.stats["flushes"] += 1
        return web.Response(text=FLUSHED)

    async def _load(self, named: list, version: Any, path: str = "tensor",
                    everything: list | None = None) -> None:
        """Every path loads through the served model's `load_weights` (as SGLang's runner),
        which a custom loader may have wrapped; a draft gets `everything` (default `named`)
        where upstream's `path` reaches it (`draft.reaches_draft`)."""
        if "weights" in self.released_tags:  # SGLang would write into unmapped GPU memory
            raise RuntimeError("the weights region is released; resume 'weights' first")
        if self.draft is not None and reaches_draft(path, self.weight_update_sessions):
            await asyncio.to_thread(self.draft.load_weights, named if everything is None
                                    else everything)
        await asyncio.to_thread(self.served_model.load_weights, named)
        self._count_update(version)

    def _count_update(self, version: Any) -> None:
        self.stats["weight_updates"] += 1
        if version is not None:
            self.weight_version = str(version)

    def _outside_session(self, what: str) -> web.Response | None:
        """SGLang 0.5.23's refusal of an update outside a weight-update session
        (managers/scheduler_components/weight_updater.py), or None."""
        if getattr(self, "weight_update_sessions", False) and not self.session_open:
            return _fail(f"{what} must run between begin_weight_update() and "
                         "end_weight_update()")
        return None

    async def begin_session(self, request: web.Request) -> web.Response:
        if self.session_open:
            return _fail("a weight-update session is already open; call end_weight_update() "
                         "first")
        self.session_open = True
        return _ok("Success")

    async def end_session(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return _ok("Success")

    async def update_from_tensor(self, request: web.Request) -> web.StreamResponse:
        """As SGLang 0.5.12: an entry that does not decode (bad base64, a class outside the
        unpickler's allow-list: utils/common.py SafeUnpickler) or a tensor of the wrong shape
        (model_loader/weight_utils.py default_weight_loader asserts the shape) raises in the
        scheduler, which ends the server; an unknown parameter name is skipped (the model's
        load_weights ignores it) and the update answers success."""
        refused = self._outside_session("update_weights_from_tensor")
        if refused is not None:
            return refused
        body = await request.json()
        if body.get("load_format") in self.custom_weight_loaders:
            return await self._custom_load(request, body)
        try:  # every TP rank deserializes its own entry (SGLang tp_worker.py)
            ranks = [decode_tensor_update(body, tp_rank=k) for k in range(self.tp_size)]
            self.received.append((body.get("load_format"), [origins(r) for r in ranks]))
            for k, other in enumerate(ranks[1:], 1):
                if [n for n, _ in other] != [n for n, _ in ranks[0]] or not all(
                        a.equal(b) for (_, a), (_, b) in zip(ranks[0], other, strict=True)):
                    raise ValueError(f"TP rank {k}'s entry holds other tensors than rank 0's")
        except Exception as e:
            return await self.die(request, f"/update_weights_from_tensor: {e}")
        shapes = {n: self.served_shape(n) for n, _ in ranks[0]}
        unknown = next((n for n in shapes if shapes[n] is None and stacked_part(n)), None)
        if unknown is not None and self.architecture() in UNCHECKED_STACKED:
            fused = unknown.replace(stacked_part(unknown), ".qkv_proj." if stacked_part(
                unknown) in (".q_proj.", ".k_proj.", ".v_proj.") else ".gate_up_proj.")
            return await self.die(request, f"KeyError: {fused!r} (load_weights of "
                                  "models/qwen3.py)")
        named = [(n, t) for n, t in ranks[0] if shapes[n] is not None]
        wrong = next(((n, t) for n, t in named if tuple(t.shape) != shapes[n]), None)
        if wrong is not None:
            return await self.die(request, f"AssertionError: {wrong[0]} has shape "
                                  f"{tuple(wrong[1].shape)}, the model {shapes[wrong[0]]}")
        try:
            await self._load(named, body.get("weight_version"), everything=ranks[0])
        except Exception as e:
            return _fail(f"Failed to update weights from tensor: {e}")
        return _ok(_versioned(TENSOR_UPDATE_OK, body))

    async def _custom_load(self, request: web.Request, body: dict) -> web.StreamResponse:
        """SGLang 0.5.12's `--custom-weight-loader` path (model_runner.py
        update_weights_from_tensor): the named tensors of this rank go to `FUNC(model, named)`;
        an exception in it ends the scheduler, so the server."""
        import importlib

        if "weights" in self.released_tags:
            return _fail("Failed to update weights from tensor: the weights region is released")
        fmt = str(body["load_format"])
        try:
            ranks = [decode_tensor_update({**body, "load_format": None}, tp_rank=k)
                     for k in range(self.tp_size)]
            self.received.append((fmt, [origins(r) for r in ranks]))
            named = ranks[0]
            module, _, func = fmt.rpartition(".")
            loader = getattr(importlib.import_module(module), func)
            await asyncio.to_thread(lambda: [loader(m, named) for m in (  # draft runner first
                self.draft, self.served_model) if m is not None])  # (eagle_worker.py)
        except Exception as e:
            return await self.die(request, f"/update_weights_from_tensor ({fmt}): "
                                  f"{type(e).__name__}: {e}")
        self._count_update(body.get("weight_version"))
        return _ok(_versioned(TENSOR_UPDATE_OK, body))

    def architecture(self) -> str:
        """The served model's architecture (config.json `architectures[0]`, "" if unknown)."""
        try:
            with open(os.path.join(self.model_path, "config.json"), encoding="utf-8") as f:
                return str((json.load(f).get("architectures") or [""])[0])
        except (OSError, ValueError, TypeError):
            return ""

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = body.get("model_path", "")
        try:
            from safetensors.torch import load_file

            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path}")
            named = [kv for f in files for kv in load_file(os.path.join(path, f)).items()]
            await self._load(named, body.get("weight_version"), "disk")
        except Exception as e:
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {e}",
                 "num_paused_requests": 0}, status=400)
        self.model_path = path
        return web.json_response(
            {"success": True, "message": _versioned("Succeeded to update model weights.", body),
             "num_paused_requests": 0})

    async def init_group(self, request: web.Request) -> web.Response:
        """The rendezvous blocks the whole server until it completes, as upstream (the
        scheduler's event loop waits in model_runner.py init_weights_update_group): with an
        unreachable master address even /health gets no answer."""
        b = await request.json()
        try:
            name = b.get("group_name", "weight_update_group")
            pg = init_learner_update_group(  # on the event loop: blocks every endpoint
                b["master_address"], int(b["master_port"]), int(b["world_size"]), name,
                b.get("backend", "nccl"), int(b["rank_offset"]),
                timeout_s=float(os.environ.get("STANDIN_GROUP_TIMEOUT_S", "600")))
            self._groups[name] = pg
        except Exception as e:
            return _fail(f"Failed to init process group: {e}")
        return _ok("Succeeded to initialize custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        import torch
        import torch.distributed as dist

        refused = self._outside_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        b = await request.json()
        name = b.get("group_name", "weight_update_group")
        if name not in self._groups:
            return _fail(f"Group {name} not in {list(self._groups)}")

        def recv() -> list:
            out = []
            for n, dt, shape in zip(b["names"], b["dtypes"], b["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dt))
                dist.broadcast(t, src=0, group=self._groups[name])
                out.append((n, t))
            return out

        try:
            named = await asyncio.to_thread(recv)
            await self._load(named, b.get("weight_version"), "distributed")
        except Exception as e:
            return _fail(f"Failed to update parameter online: {e}")
        return _ok(_versioned("Succeeded to update parameter online.", b))

    async def destroy_group(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        name = (await request.json()).get("group_name", "weight_update_group")
        pg = self._groups.pop(name, None)
        if pg is None:
            return _fail(f"Group {name} not found")
        dist.destroy_process_group(pg)
        return _ok("Succeeded to destroy custom process group.")

    async def weights_digest(self, request: web.Request) -> web.Response:
        """Stand-in only (SGLang has no such endpoint): `weights_digest` of the served
        parameters, the weight version and the counters, for tests comparing them with the
        learner's."""
        named = list(self.engine.model.named_parameters())
        return web.json_response({"digest": await asyncio.to_thread(weights_digest, named),
                                  "weight_version": self.weight_version, "stats": self.stats,
                                  "draft": self.draft.checksums() if self.draft else None})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = await request.json()
        self.weight_version = str(b.get("new_version", ""))
        return web.json_response(
            {"success": True, "message": "ok", "new_version": self.weight_version}
        )

    async def release(self, request: web.Request) -> web.Response:
        tags = await _memory_tags(request)
        if isinstance(tags, web.Response):
            return tags
        self.released_tags |= set(tags)
        self.released = True
        self.memory_log.append("release " + ",".join(tags))
        if "weights" in tags:
            await self.engine.arelease_memory()
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = await _memory_tags(request)
        if isinstance(tags, web.Response):
            return tags
        missing = [t for t in tags if t not in self.released_tags]
        if missing:  # SGLang: the KeyError of the scheduler's resume ends the server
            return await self.die(request, f"KeyError: {missing[0]!r} (memory region not "
                                  "released; managers/scheduler_update_weights_mixin.py)")
        self.released_tags -= set(tags)
        self.released = bool(self.released_tags)
        self.memory_log.append("resume " + ",".join(tags))
        if "weights" in tags:
            await self.engine.aresume_memory()
            if not self.weights_cpu_backup:
                await asyncio.to_thread(self._lose_weights)
        return web.json_response(None)

    def _lose_weights(self) -> None:
        """What SGLang's memory saver does to weights released without CPU backup: the
        re-mapped GPU memory does not hold them (its contents are undefined). The stand-in
        zeroes every parameter, so generation runs but answers garbage until the weights are
        pushed again; `lost_weights` names the parameters not yet re-pushed."""
        import torch

        with torch.no_grad():
            for name, p in self.engine.model.named_parameters():
                p.zero_()
                self.lost_weights.add(name)


class ServedModel:
    """What SGLang's runner calls `model`: `load_weights(pairs)` skips names the model lacks
    and asserts the shape of the others (default_weight_loader), then copies them in."""

    def __init__(self, server: Any) -> None:
        self.server = server

    @property
    def config(self) -> Any:
        return self.server.engine.model.config

    def load_weights(self, weights: Any) -> None:
        engine = self.server.engine
        rx = getattr(self.server, "fp8_rx", None)
        if rx is not None:  # an FP8 model: weights and their scales are its parameters
            weights = rx.take(weights)
        else:  # a BF16 model given FP8 bytes: default_weight_loader's copy_ casts them unscaled
            weights = [(n, t.float() if t.dtype == FP8_DTYPE else t) for n, t in weights]
        named = [(n, t) for n, t in weights if engine.param_shape(n) is not None]
        if type(engine.model).__name__ in FUSED_A_PROJ and getattr(
                engine.model.config, "q_lora_rank", None) is not None:
            named = fuse_a_proj(named)
        for n, t in named:
            if tuple(t.shape) != engine.param_shape(n):
                raise AssertionError(f"{n} has shape {tuple(t.shape)}, the model "
                                     f"{engine.param_shape(n)}")
        engine.load_buckets([named], engine.weight_version)
        self.server.lost_weights.difference_update(n for n, _ in named)


#: Architectures whose SGLang load_weights fuses each layer's `q_a_proj` and
#: `kv_a_proj_with_mqa` into `fused_qkv_a_proj_with_mqa` when `q_lora_rank` is set
#: (models/deepseek_common/deepseek_weight_loader.py, 0.5.12 and 0.5.23).
FUSED_A_PROJ = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def fuse_a_proj(named: list) -> list:
    """As SGLang's DeepSeek loader: a layer's two attention down-projections are cached within
    one load_weights call (`cached_a_proj`) and loaded once both arrived; one whose partner is
    not in the same call is dropped without a word."""
    cached: dict = {}
    out = []
    for n, t in named:
        if "q_a_proj" not in n and "kv_a_proj_with_mqa" not in n:
            out.append((n, t))
            continue
        cached[n] = t
        q = n.replace("kv_a_proj_with_mqa", "q_a_proj")
        kv = n.replace("q_a_proj", "kv_a_proj_with_mqa")
        if q in cached and kv in cached:
            out += [(q, cached.pop(q)), (kv, cached.pop(kv))]
    return out


def origins(named: Any) -> list[str]:
    """Where the memory of each received tensor lives, as its handle names it: "cuda:N" (a
    CUDA IPC handle names its device), "pid:P" (host shared memory: torch names the file
    /torch_<P>_..., P the process that shared it), "local" otherwise."""
    import re

    out = []
    for _, t in named:
        st = t.untyped_storage()
        if t.is_cuda:
            out.append(f"cuda:{t.device.index}")
            continue
        try:  # a storage shared another way (file descriptor) has no such name
            mo = re.match(rb"/torch_(\d+)_", st._share_filename_cpu_()[1]) if (
                st.is_shared() and st.nbytes()) else None
        except RuntimeError:
            mo = None
        out.append(f"pid:{int(mo.group(1))}" if mo else "local")
    return out


def weights_digest(named: Any) -> str:
    """SHA-256 over (name, shape, float32 bytes) of the named tensors, in name order."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


#: model_executor/model_runner.py update_weights_from_tensor's answer (also for names it skips).
TENSOR_UPDATE_OK = "Success"
#: entrypoints/http_server.py /flush_cache's answer.
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")


def _versioned(msg: str, body: dict) -> str:
    """A weight update's success text: managers/tokenizer_control_mixin.py appends the new
    version when the request names one."""
    v = body.get("weight_version")
    return msg if v is None else f"{msg} Weight version updated to {v}."


def _ok(msg: str) -> web.Response:
    return web.json_response({"success": True, "message": msg})


def _fail(msg: str) -> web.Response:
    return web.json_response({"success": False, "message": msg}, status=400)


def _bad(msg: str) -> web.Response:
    return web.json_response({"object": "error", "message": msg, "code": 400}, status=400)


async def _memory_tags(request: web.Request) -> list[str] | web.Response:
    """The `tags` of a release/resume request (None or [] = all regions, as in SGLang's
    scheduler_update_weights_mixin.py), or a 400 answer naming an unknown tag."""
    text = await request.text()
    try:
        tags = (json.loads(text) or {}).get("tags") if text.strip() else None
    except (ValueError, AttributeError):
        return _bad("body must be a JSON object with optional 'tags'")
    tags = list(tags or MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        return _bad(f"unknown memory tag {bad[0]!r}; expected one of {list(MEMORY_TAGS)}")
    return tags
