"""``SpeculativeConfig(**dict)`` as strict as the real pydantic dataclass, per vLLM version."""

from vllm._layout import spec_fields

METHODS = ("ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp", "suffix", "dflash")
MTP_ALIASES = ("deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp", "qwen3_5_mtp",
               "longcat_flash_mtp", "pangu_ultra_moe_mtp")

PYDANTIC_URL = "https://errors.pydantic.dev/2.11/v"


class SpecConfigError(Exception):
    """Carries the exception line as the real vLLM would print it (last line of the traceback)."""

    def __init__(self, exc_line, frames=None):
        super().__init__(exc_line)
        self.exc_line = exc_line
        self.frames = frames or []


def allowed_keys(version: str) -> set:
    """The init fields of this version's SpeculativeConfig: the same table vllm/config/speculative.py is laid out
    from (vllm._layout.SPEC_FIELDS)."""
    return set(spec_fields(version))


def _input_type(v):
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict",
            type(None): "NoneType"}.get(type(v), type(v).__name__)


def validate(spec: dict, version: str) -> dict:
    """Return the normalised dict, or raise SpecConfigError with the real-looking error text."""
    if not isinstance(spec, dict):
        raise SpecConfigError(f"TypeError: vllm.config.speculative.SpeculativeConfig() argument after ** must be "
                              f"a mapping, not {type(spec).__name__}")
    errors = []
    allowed = allowed_keys(version)
    for key, val in spec.items():
        if key not in allowed:
            errors.append(f"{key}\n  Unexpected keyword argument [type=unexpected_keyword_argument, "
                          f"input_value={val!r}, input_type={_input_type(val)}]\n"
                          f"    For further information visit {PYDANTIC_URL}/unexpected_keyword_argument")
    k = spec.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        errors.append(f"num_speculative_tokens\n  Input should be a valid integer [type=int_type, "
                      f"input_value={k!r}, input_type={_input_type(k)}]\n"
                      f"    For further information visit {PYDANTIC_URL}/int_type")
    sched = spec.get("num_speculative_tokens_per_batch_size")
    if sched is not None and "num_speculative_tokens_per_batch_size" in allowed and not (
            isinstance(sched, list) and all(isinstance(e, list) and len(e) == 3 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in e) for e in sched)):
        # pydantic's list[tuple[int, int, int]]: the shape only; the ranges are the scheduler's to check
        errors.append(f"num_speculative_tokens_per_batch_size\n  Input should be a valid list of (int, int, int) "
                      f"tuples [type=list_type, input_value={sched!r}, input_type={_input_type(sched)}]\n"
                      f"    For further information visit {PYDANTIC_URL}/list_type")
    method = spec.get("method")
    if method is not None and (method not in METHODS and method not in MTP_ALIASES):
        lits = ", ".join(f"'{m}'" for m in METHODS + MTP_ALIASES)
        errors.append(f"method\n  Input should be {lits} [type=literal_error, input_value={method!r}, "
                      f"input_type={_input_type(method)}]\n"
                      f"    For further information visit {PYDANTIC_URL}/literal_error")
    if errors:
        n = len(errors)
        raise SpecConfigError(
            f"pydantic_core._pydantic_core.ValidationError: {n} validation error{'s' if n > 1 else ''} for "
            f"SpeculativeConfig\n" + "\n".join(errors))
    return dict(spec)
