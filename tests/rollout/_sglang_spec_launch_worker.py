"""Run with an SGLang venv's python (tests/rollout/test_speculative_sglang_launch.py): SGLang's own
`prepare_server_args` reads a speculative server's command line as our launcher builds it
(`rollout.sglang.speculative.speculative_server_args` after the CPU engine's flags) and prints
"RESULT {...}": the release and the speculative fields as SGLang resolved them (algorithm after
its NEXTN alias, the draft model path, steps / top-k / draft tokens, overlap schedule, the
running-request cap), or "ERROR <type>: <message>" when SGLang refuses the command line.

Usage: python _sglang_spec_launch_worker.py ARGV_JSON (the arguments after `-m MODULE`)."""

import json
import sys


def main(argv: list[str]) -> None:
    import sglang
    from sglang.srt.server_args import prepare_server_args

    try:
        args = prepare_server_args(argv)
        if hasattr(args, "resolve_once"):  # 0.5.23: launch_server.py run_server resolves
            args.resolve_once()  # the record; its values are read through resolving_view
            from sglang.srt.arg_groups.overrides import resolving_view

            args = resolving_view(args)
    except Exception as e:  # noqa: BLE001 - SGLang's refusal is the result
        print(f"ERROR {type(e).__name__}: {e}")
        return
    print("RESULT " + json.dumps({
        "version": sglang.__version__, "algorithm": args.speculative_algorithm,
        "draft_model_path": args.speculative_draft_model_path,
        "num_steps": args.speculative_num_steps, "topk": args.speculative_eagle_topk,
        "num_draft_tokens": args.speculative_num_draft_tokens,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "max_running_requests": args.max_running_requests, "device": args.device,
        "attention_backend": args.attention_backend,
        "custom_weight_loader": args.custom_weight_loader}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
