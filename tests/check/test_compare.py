"""Comparing the run's args with a checkpoint: what each finding tells the user to do."""

from megatron_preflight.check.compare import compare_architecture
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.layout.discover import discover
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS


def test_a_padded_vocab_change_says_how_to_keep_the_saved_padding():
    """tp2_torch (vocab 100) was saved at TP2 with the default divisor: 256 rows. At TP1 the vocab pads to 128, and the
    padding rows' logits leave the softmax; the fix names the divisor that keeps 256 rows at TP1 (resumed in
    Megatron-LM with it, the first loss equals a same-layout resume's: the note of this change)."""
    layout = discover(fixture_path("tp2_torch"))
    [f] = [f for f in compare_architecture(layout, from_cli([*FLAGS, "--tensor-model-parallel-size", "1"]))
           if f.field == "padded_vocab_size"]
    assert (f.checkpoint, f.runtime) == (256, 128)
    assert "softmax" in f.message and "--make-vocab-size-divisible-by 256" in f.fix
    kept = from_cli([*FLAGS, "--tensor-model-parallel-size", "1", "--make-vocab-size-divisible-by", "256"])
    assert not [f for f in compare_architecture(layout, kept) if f.field == "padded_vocab_size"]
