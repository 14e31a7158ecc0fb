"""megatron/trainer/core_overrides.py: the installed megatron-core has every internal the
trainer relies on, and a moved or changed one stops start-up with a message naming it."""

import importlib

import pytest

from megatron.trainer import core_overrides
from megatron.trainer.core_overrides import INTERNALS, CoreInternalsError, Internal, verify


def test_installed_megatron_core_has_every_declared_internal():
    verify()


def _owner_and_name(target: str):
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


@pytest.mark.parametrize("declared", INTERNALS, ids=[i.target.split(":")[1] for i in INTERNALS])
def test_a_target_gone_from_megatron_core_is_named_with_its_user(monkeypatch, declared):
    owner, name = _owner_and_name(declared.target)
    monkeypatch.delattr(owner, name)
    with pytest.raises(CoreInternalsError) as error:
        verify()
    message = str(error.value)
    assert declared.target in message
    assert declared.user in message


def test_a_changed_signature_names_what_was_expected(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.setattr(schedules, "backward_step", lambda output_tensor, config: None)
    with pytest.raises(CoreInternalsError) as error:
        verify()
    message = str(error.value)
    assert "schedules:backward_step takes (output_tensor, config)" in message
    assert "(input_tensor, output_tensor, output_tensor_grad, config)" in message


def _backward_step_old(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron-core <= 0.16's parameters."""


def _backward_step_new(input_tensor, output_tensor, output_tensor_grad, config):
    """megatron-core >= 0.17's parameters."""


@pytest.mark.parametrize("function, variant", [(_backward_step_old, 0), (_backward_step_new, 1)])
def test_either_backward_step_signature_is_accepted_and_told_apart(monkeypatch, function,
                                                                    variant):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.setattr(schedules, "backward_step", function)
    verify()
    assert core_overrides.internal(":backward_step").variant() == variant


def test_megatron_core_no_longer_reading_a_name_is_reported():
    needs_missing_name = Internal(
        "megatron.core.tensor_parallel.layers:_grad_accum_fusion_available", "private",
        "training/no_apex.py weight_grad_accumulation_fusion",
        read_by=("fused_weight_gradient_mlp_cuda.renamed_kernel",))
    with pytest.raises(CoreInternalsError, match="no longer uses fused_weight_gradient_mlp_cuda"
                                                 ".renamed_kernel"):
        verify((needs_missing_name,))


def test_a_stand_in_whose_parameters_drift_from_megatron_cores_is_reported(monkeypatch):
    from megatron.trainer.attention import SDPAttention

    def forward(self, query, key, value, attention_mask, attn_mask_type=None):
        """lacks attention_bias and packed_seq_params, which megatron.core passes"""

    monkeypatch.setattr(SDPAttention, "forward", forward)
    with pytest.raises(CoreInternalsError, match="its stand-in megatron.trainer.attention:"
                                                 "SDPAttention.forward takes"):
        verify()
