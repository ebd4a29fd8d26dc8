"""Which of the training step's alternative kernels run: one frozen value, built once, carried to the kernels.

Every fast path of the hot path has a slower twin it is held to (float64 reference tests, benchmarks).
Tests and benchmarks choose between them here instead of assigning module globals: a global flipped in
the trainer never reached a Hogwild worker started from a fork server or spawned (it imports the module
afresh), and one left flipped by a failing test leaked into the tests after it. The trainer takes its
options from its ``Collaborators`` (job/train/trainer.py), hands them to its worker pool at start, and every
batch reads them from its ``BatchContext`` (job/train/batch/step.py) down to the scoring code (``Model.score_batch``).

No config key or environment variable drives any of them: the defaults are what training runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    """The training step's choices of kernel; the defaults are the fast paths training takes."""

    deferred_positives: bool = True
    """Reciprocal scoring gathers its positives as their own leaf and adds their gradient into the batch rows'
    after backward (``job.model.deferred``): autograd's gather would zero-fill and sum a gradient of every
    gathered row (~17 MB per side on a large table). Off: the positives are gathered through autograd, the
    reference tests/test_fused.py holds the deferred merge to."""

    native_loss: bool = True
    """A side's softmax or ranking loss runs as one native pass per row (``losskernels.c``) where the kernels
    load. Off: the torch form (``job.model.fused_losses.blockwise_loss``), which runs anyway where the kernels
    do not load or do not serve; tests/test_fused.py holds both to autograd."""

    operator_adjoint: bool = True
    """Under ``dot`` a static relation's rhs operator goes on the ~B anchors as its adjoint and the uniform
    negatives are scored raw (``job.model.fused_pair.fused_pair_adjoint``), instead of the operator over every
    unique rhs row. Off: ``fused_pair``, the operator on every row (tests/test_fused_adjoint.py, and the
    comparison bench/precision_bench.py --adjoint makes)."""

    fused_all_negs: bool = True
    """1-vs-all softmax (``all_negs``, dot, no bias) differentiated by hand (``job.model.fused_all``). Off: the
    autograd path, which tests/test_fused_all.py holds it to and bench/batch_profile.py --autograd-all times."""

    static_shapes_on_cpu: bool = False
    """Run the GPU's static-shape step (every occurrence gathered, repeated rows summed inside the Adagrad step:
    what job/train/batch/graphs.py captures into CUDA graphs) on the CPU, so that tests without a GPU exercise it.
    Off on the CPU by default: there the unique rows, or ``occurrences_on_cpu``'s layout, are cheaper."""

    occurrences_on_cpu: bool = True
    """A trained CPU batch of a large table gathers every occurrence of its rows (negatives scored in place,
    repeats merged before the Adagrad step: ``job.train.batch.rowops.occurrences_pay``). Off: the unique rows, the
    path tests/test_fused.py holds it to."""


DEFAULT_KERNEL_OPTIONS = KernelOptions()
