"""python -m vpd_testbed.realvllm: build the real-vLLM runtime and tiny models into the cache (once per machine;
scripts/test.sh runs this before the tests). Prints why it cannot when it cannot (and exits 0: the tier then skips
with that reason); exit 1 when a build fails."""
import sys
import time

from . import RealVllmUnavailable, ensure_models, ensure_runtime, models_path, runtime_path, unavailable_reason


def main() -> int:
    why = unavailable_reason()
    if why:
        print("real vLLM: not built here: %s (its tests skip)" % why, file=sys.stderr)
        return 0
    t0 = time.monotonic()
    cached = (runtime_path() / ".vpd-complete").exists() and (models_path() / ".vpd-complete").exists()
    say = (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        venv = ensure_runtime(say)
        models = ensure_models(say)
    except RealVllmUnavailable as e:
        print("real vLLM: %s" % e, file=sys.stderr)
        return 1
    print("real vLLM: %s %s (%s, %.1f s)" % (venv, models, "cached" if cached else "built", time.monotonic() - t0),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
