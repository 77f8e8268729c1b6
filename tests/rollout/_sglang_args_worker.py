"""Runs with SGLang 0.5.12's Python pieces on the path: parses our launch command lines with
SGLang's own `prepare_server_args` and compares SGLang's port rule, context length and API-key
decision with ours; prints one JSON line for tests/rollout/test_sglang_real_args.py (or a
"SKIP <reason>" line when a piece is missing).

Importing `sglang.srt.server_args` on a CPU machine needs a stand-in for torchvision (SGLang's
multimodal configs import it at module level), transformers' image utilities imported first
(they would otherwise see that stand-in), and SGLang's extra Transformers registrations allowed
to repeat names this transformers version already has."""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import types


class _AnyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _AnyModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def _prepare():
    import transformers
    import transformers.image_utils  # noqa: F401  (before the stub: no torchvision here)
    import transformers.models.auto.processing_auto  # noqa: F401

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or built for another torch
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _TorchvisionStub())
    for cls in (transformers.AutoConfig, transformers.AutoProcessor, transformers.AutoTokenizer,
                transformers.AutoImageProcessor):
        orig = cls.register

        def register(*a, _orig=orig, **k):
            try:
                return _orig(*a, **{**k, "exist_ok": True})
            except (TypeError, ValueError):
                return None

        cls.register = staticmethod(register)


def main() -> None:
    try:
        _prepare()
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.server_args import ServerArgs, prepare_server_args
        from sglang.srt.utils.auth import AuthLevel, decide_request_auth
    except ImportError as e:
        print(f"SKIP SGLang's server_args does not import here: {e}")
        return
    from transformers import Qwen3Config

    from megatron_gspo.rollout.sglang.launch import LaunchSpec, pick_ports, server_argv
    from megatron_gspo.rollout.sglang.protocol import (
        auth_allowed,
        context_length_of,
        grpc_port_error,
    )

    out: dict = {}
    model = tempfile.mkdtemp()
    cfg = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=256, architectures=["Qwen3ForCausalLM"])
    Qwen3Config(**cfg).save_pretrained(model)

    def parse(argv):  # our argv after "python -m module"; SGLang needs a device on CPU
        return prepare_server_args(list(argv[3:]) + ["--device", "cpu"])

    spec = LaunchSpec(model_path=model, num_servers=2, tp_size=2, mem_fraction_static=0.6,
                      colocated=True, base_gpu_id=2, seed=7, dtype="bfloat16", api_key="k",
                      extra_args=["--context-length", "128"])
    port = pick_ports("127.0.0.1", 0, 1)[0]
    a = parse(server_argv(spec, 1, port, 25001))
    out["parsed"] = {k: getattr(a, k) for k in (
        "model_path", "host", "port", "tp_size", "base_gpu_id", "random_seed", "dtype",
        "mem_fraction_static", "enable_memory_saver", "api_key", "context_length", "nccl_port")}
    out["expected"] = {"model_path": model, "host": "127.0.0.1", "port": port, "tp_size": 2,
                       "base_gpu_id": 4, "random_seed": 8, "dtype": "bfloat16",
                       "mem_fraction_static": 0.6, "enable_memory_saver": True,
                       "api_key": "k", "context_length": 128, "nccl_port": 25001}
    # every port pick_ports hands out is one SGLang accepts
    ports = pick_ports("127.0.0.1", 0, 40)
    refused = []
    for p in ports[:10] + [max(ports)]:
        try:
            parse(server_argv(LaunchSpec(model_path=model), 0, p))
        except ValueError as e:
            refused.append([p, str(e)])
    out["picked_refused"] = refused
    # the port rule: SGLang's verdict and message against ours
    verdicts = {}
    for p, grpc in ((55535, None), (55536, None), (60000, None), (3000, "70001"),
                    (60000, "4000")):
        env = {} if grpc is None else {"SGLANG_GRPC_PORT": grpc}
        os.environ.pop("SGLANG_GRPC_PORT", None)
        os.environ.update(env)
        try:
            parse(server_argv(LaunchSpec(model_path=model), 0, p))
            theirs = None
        except ValueError as e:
            theirs = str(e)
        verdicts[f"{p}/{grpc}"] = [theirs, grpc_port_error(p, env)]
    os.environ.pop("SGLANG_GRPC_PORT", None)
    out["port_rule"] = verdicts
    # context length: SGLang's ModelConfig against ours, plain and with rope scaling
    contexts = {}
    for name, extra in (("plain", {}),
                        ("yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})):
        d = tempfile.mkdtemp()
        Qwen3Config(**cfg, **extra).save_pretrained(d)
        mc = ModelConfig.from_server_args(ServerArgs(model_path=d, device="cpu"))
        with open(os.path.join(d, "config.json")) as f:
            contexts[name] = [mc.context_len, context_length_of(json.load(f))]
    out["context"] = contexts
    # the API-key decision
    auth = {}
    for path in ("/generate", "/health", "/health_generate", "/update_weights_from_tensor"):
        for header in (None, "Bearer k", "Bearer x", "bearer k", "Basic k"):
            for level in (AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL):
                theirs = decide_request_auth(method="POST", path=path, authorization_header=header,
                                             api_key="k", admin_api_key=None,
                                             auth_level=level).allowed
                auth[f"{path} {header} {level.value}"] = [theirs, auth_allowed(path, header, "k")]
    out["auth"] = auth
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
