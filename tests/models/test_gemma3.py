"""Gemma3 against HF transformers and PEFT."""

import pytest
from family_checks import assert_aligned, assert_meta_weights_complete, assert_state_dict_round_trip

MODEL_TYPE = "gemma3_text"
# Tiny-config overrides (on top of the ModelSpec's tiny_hf_config) that exercise the family's features.
CASES = {"tiny": {}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])
