"""``vllm`` command line of the fake vLLM (test bed): ``vllm serve MODEL [flags]``, ``vllm --version``."""

import argparse
import json
import os
import sys

ATTENTION_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TREE_ATTN", "XFORMERS",
                      "ROCM_ATTN", "FLASHMLA", "CUTLASS_MLA", "TRITON_MLA", "FLASH_ATTN_MLA", "NO_ATTENTION")


def loads(value):  # the name shows in argparse's "invalid loads value" message, as in vLLM
    return json.loads(value)


def _backend(value):
    v = value.upper()
    if v not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(b.lower() for b in ATTENTION_BACKENDS)})")
    return v


def _human_int(value):
    v = str(value).strip().lower()
    mult = 1
    for suf, m in (("k", 1000), ("m", 1000 ** 2), ("g", 1000 ** 3)):
        if v.endswith(suf):
            mult, v = m, v[:-1]
            break
    if v in ("-1", "auto"):
        return -1
    try:
        return int(float(v) * mult) if mult != 1 else int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid max model length: {value!r}")


def _normalise_argv(argv):
    """FlexibleArgumentParser: --foo_bar == --foo-bar, --flag=value supported."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            key, eq, val = a.partition("=")
            out.append(key.replace("_", "-") + eq + val)
        else:
            out.append(a)
    return out


def _add_serve_args(p):
    B = argparse.BooleanOptionalAction
    p.add_argument("model_tag", nargs="?", default=None, help="The model tag to serve")
    p.add_argument("--model", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uds", default=None)
    p.add_argument("--api-key", nargs="+", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=_human_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--speculative-config", "-sc", type=loads, default=None)
    p.add_argument("--attention-backend", type=_backend, default=None)
    p.add_argument("--disable-log-stats", action="store_true", default=False)
    p.add_argument("--enable-log-requests", action=B, default=False)
    p.add_argument("--disable-log-requests", action="store_true", default=False)
    p.add_argument("--disable-uvicorn-access-log", action="store_true", default=False)
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--trust-remote-code", action=B, default=False)
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--enforce-eager", action=B, default=False)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"])
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=4)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=B, default=None)
    p.add_argument("--enable-chunked-prefill", action=B, default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--download-dir", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--generation-config", default="auto")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=False)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--limit-mm-per-prompt", type=loads, default=None)
    p.add_argument("--language-model-only", action=B, default=False)
    p.add_argument("--mamba-cache-mode", default=None)
    p.add_argument("--compilation-config", "-O", type=loads, default=None)
    p.add_argument("--hf-overrides", type=loads, default=None)
    p.add_argument("--override-generation-config", type=loads, default=None)




def build_parser():
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM CLI")
    parser.add_argument("-v", "--version", action="store_true", help="show the version and exit")
    sub = parser.add_subparsers(dest="subparser")
    serve = sub.add_parser("serve", help="Launch a local OpenAI-compatible API server to serve LLM completions",
                           usage="vllm serve [model_tag] [options]")
    _add_serve_args(serve)
    return parser, serve


def main(argv=None):
    argv = _normalise_argv(list(sys.argv[1:] if argv is None else argv))
    parser, serve = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        import vllm
        print(vllm.__version__)
        return 0
    if args.subparser != "serve":
        parser.print_help()
        return 0
    model = args.model_tag or args.model
    if not model:
        serve.error("the following arguments are required: model_tag")
    args.model = model
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        args.api_key = [os.environ["VLLM_API_KEY"]]
    defaults = vars(serve.parse_args([model]))
    non_default = {"model_tag": model}
    for k, v in vars(args).items():
        if k in ("model_tag", "subparser", "version", "api_key"):
            continue
        if defaults.get(k) != v:
            non_default[k] = v
    import vllm  # noqa: F401  (a broken build fails here, like the real one)
    from vllm._fake.server import serve_main
    rc = serve_main(args, non_default)
    sys.exit(rc)


if __name__ == "__main__":
    main()
