"""extraVllmArgs refuses the vLLM flags the operator owns in every spelling vLLM 0.32's parser accepts
(abbreviations, '_' for '-', flag=value, the short aliases -tp/-pp/-dp, --config), through the path the
operator parses pools with, with a message naming the field that sets the flag; the CRD's CEL agrees;
and the list is checked against vLLM's own parser. model.maxModelLength is bounded."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.api.loader import SpecError
from tessera.api.serving_pool import (
    OPERATOR_OWNED_VLLM_FLAGS,
    VLLM_FLAG_SOURCES,
    VLLM_FLAGS_READ,
    ServingPoolSpec,
)
from tessera.control.pool_plan import parse

POOL = next(
    d
    for d in yaml.safe_load_all(
        (Path(__file__).resolve().parents[1] / "examples/quickstart.yaml").read_text()
    )
    if d["kind"] == "ServingPool"
)
RULE = ServingPoolSpec.RULES[0]

# (extraVllmArgs, the field the message must name)
REFUSED = [
    (["--max_model_len", "4096"], "model.maxModelLength"),
    (["--max-model-len=4096"], "model.maxModelLength"),
    (["--max-model", "4096"], "model.maxModelLength"),  # an abbreviation argparse resolves
    (["-tp", "8"], "model.tensorParallelSize"),
    (["-tp=8"], "model.tensorParallelSize"),
    (["-t", "8"], "model.tensorParallelSize"),
    (["--tensor_parallel_size", "8"], "model.tensorParallelSize"),
    (["--tensor-parallel", "8"], "model.tensorParallelSize"),
    (["--config", "/etc/vllm.yaml"], "a file set any of these flags"),
    (["--config=/x.yaml"], "a file set any of these flags"),
    (["--port", "9000"], "loopback"),
    (["--uds", "/tmp/s"], "loopback"),
    (["--model", "other/model"], "the LLMService's model"),
    (["--model=other"], "the LLMService's model"),
    (["--served_model_name", "x"], "model.name"),
    (["--max_num_seqs=1024"], "autoscaling.batchSize.max"),
    (["--dtype", "float16"], "model.dtype"),
    (["-pp", "2"], "the placement"),
    (["--data_parallel_size=2"], "the placement"),
    (["-dp", "2"], "the placement"),
    (["--api-key", "k"], "without a key"),
    (["--kv-events-config", '{"enable_kv_cache_events": true}'], "kvEvents"),
    (["--kv_events_config={}"], "kvEvents"),
    (["--host=0.0.0.0"], "loopback"),
    # Flags the operator reads from extraVllmArgs: only their exact spelling, or it would not see them.
    (["--gpu_memory_utilization", "0.95"], "--gpu-memory-utilization: spell it so"),
    (["--gpu-memory=0.95"], "--gpu-memory-utilization: spell it so"),
    (["--device-memory-utilization=0.95"], "use that name"),
    (["--max-num-batched", "4096"], "--max-num-batched-tokens: spell it so"),
]
ACCEPTED = [
    "--enable-prefix-caching",
    "--gpu-memory-utilization",
    "0.90",
    "--max-num-batched-tokens=8192",
    "--model-impl",
    "vllm",
    "--max-logprobs",
    "5",
    "--tokenizer-mode=auto",
    "-O3",
    "--compilation-config.level",
    "3",
    "--portable",
]


def _pool(args: list[str]) -> dict[str, Any]:
    body = copy.deepcopy(POOL)
    body["spec"]["extraVllmArgs"] = args
    return body


@pytest.mark.parametrize(("args", "field"), REFUSED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_owned_flags_are_refused_in_every_spelling_naming_the_field(args: list[str], field: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse(_pool(["--enable-prefix-caching", *args]))
    message = str(raised.value)
    assert "extraVllmArgs[1]" in message and repr(args[0]) in message and field in message, message


def test_other_flags_pass_and_cel_agrees_with_python() -> None:
    import celpy

    parse(_pool(ACCEPTED))
    env = celpy.Environment()
    program = env.program(env.compile(RULE.cel()))
    cases = [[a] for a in ACCEPTED] + [args for args, _ in REFUSED]
    for args in cases:
        cel = bool(program.evaluate({"self": celpy.json_to_cel({"extraVllmArgs": args})}))
        assert cel == (RULE.violation({"extraVllmArgs": args}) is None), args
    assert all(flag in dict(VLLM_FLAG_SOURCES) for flag in OPERATOR_OWNED_VLLM_FLAGS)


# One valid value per owned destination of vLLM's parser (None: the flag takes no value).
VALUES = {
    "model": "m2",
    "served_model_name": "x",
    "host": "1.2.3.4",
    "port": "1234",
    "uds": "/tmp/s",
    "api_key": "k",
    "tensor_parallel_size": "2",
    "pipeline_parallel_size": "2",
    "data_parallel_size": "2",
    "max_num_seqs": "7",
    "dtype": "float16",
    "max_model_len": "77",
    "kv_events_config": '{"enable_kv_cache_events": true}',
    "enable_lora": "true",
    "max_loras": "3",
    "max_lora_rank": "32",
    "max_cpu_loras": "5",
}
# The destinations of the flags the operator reads (VLLM_FLAGS_READ).
READ_VALUES = {"gpu_memory_utilization": "0.5", "max_num_batched_tokens": "4096"}


def _spellings(option: str) -> set[str]:
    """Every prefix of ``option`` (dashes kept), and with '_' for '-' in long options."""
    dashes = "--" if option.startswith("--") else "-"
    body = option[len(dashes) :]
    out = set()
    for end in range(1, len(body) + 1):
        out.add(dashes + body[:end])
        if dashes == "--":
            out.add(dashes + body[:end].replace("-", "_"))
    return out


@pytest.mark.integration  # imports vLLM (torch): over a minute on a loaded machine
@pytest.mark.slow
def test_the_list_matches_vllm_s_parser() -> None:
    """Against vLLM's own parser: every spelling that sets an owned destination is refused, and no
    option of vLLM that sets anything else is."""
    pytest.importorskip("vllm")
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    read = {o for o, d in by_option.items() if d in READ_VALUES}
    assert set(VLLM_FLAGS_READ) <= read
    # Owned: every option of an owned destination, and the other names of the flags the operator reads.
    owned = {o for o, d in by_option.items() if d in VALUES or d == "config"} | (read - set(VLLM_FLAGS_READ))
    assert {o for o, d in by_option.items() if d == "config"} == {"--config"}
    assert owned == set(OPERATOR_OWNED_VLLM_FLAGS), sorted(owned ^ set(OPERATOR_OWNED_VLLM_FLAGS))
    defaults = vars(parser.parse_args([]))

    def sets_owned(args: list[str]) -> bool:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
            parsed = vars(parser.parse_args(args))
            return any(parsed[d] != defaults[d] for d in {**VALUES, **READ_VALUES})
        return False

    # The refused spellings above are real: vLLM maps each onto a flag the operator sets.
    assert [args for args, _ in REFUSED if "--config" not in args[0] and not sets_owned(args)] == []
    # Every abbreviation and '_' spelling of every owned option is refused (argparse resolves each
    # unambiguous one; the rule does not depend on which are ambiguous today).
    missed = [
        spelling
        for option, dest in by_option.items()
        if dest in VALUES or dest in READ_VALUES or dest == "config"
        for spelling in _spellings(option)
        if spelling not in VLLM_FLAGS_READ
        and (
            RULE.violation({"extraVllmArgs": [spelling]}) is None
            or RULE.violation({"extraVllmArgs": [f"{spelling}=1"]}) is None
        )
    ]
    assert missed == []
    assert all(RULE.violation({"extraVllmArgs": [f, f"{f}=1"]}) is None for f in VLLM_FLAGS_READ)
    wrongly = [o for o, d in by_option.items() if o not in owned and RULE.violation({"extraVllmArgs": [o]})]
    assert wrongly == []


@pytest.mark.parametrize("length", [15, 2**24 + 1, 10**12])
def test_max_model_length_is_bounded(length: int) -> None:
    from tessera.api.llm_service import MAX_MODEL_LENGTH

    docs = yaml.safe_load_all((Path(__file__).resolve().parents[1] / "examples/quickstart.yaml").read_text())
    service = next(d for d in docs if d["kind"] == "LLMService")
    service["spec"]["model"]["maxModelLength"] = MAX_MODEL_LENGTH
    parse(service)
    service["spec"]["model"]["maxModelLength"] = length
    with pytest.raises(SpecError, match=r"model\.maxModelLength"):
        parse(service)
