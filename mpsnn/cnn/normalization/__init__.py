"""The normalization family: batch normalization (statistics over sub-batches, fused
neurons), instance and group normalization, their data sources and parameter states.

Batch normalization (MPS ``MPSCNNBatchNormalization``, ``…Statistics``, ``…Gradient``,
``…StatisticsGradient``, ``MPSCNNBatchNormalizationState``): the training step, per channel
``c`` over the whole batch's ``m = N·H·W`` values (the math and the derivation of the gradient
are in `mpsnn.ops.batch_norm`)::

    statistics       BatchNormalizationStatistics.encode_batch(cb, x_k, state)   for each
                     sub-batch k: the state accumulates (count, mean, m2) — Chan's merge;
    forward          BatchNormalization.encode_batch(cb, x_k, state):
                     y = f(gamma (x - mean)/sqrt(var + eps) + beta), var = m2/m (biased);
    gradient sums    BatchNormalizationStatisticsGradient.encode_batch(cb, g_k, x_k, state):
                     Σ gy and Σ gy·xhat with gy = g f'(z) (the fused neuron's gradient first)
                     = gradient_for_beta and gradient_for_gamma;
    input gradient   BatchNormalizationGradient.encode_batch(cb, g_k, x_k, state):
                     dx = gamma/sqrt(var + eps) (gy - Σgy/m - xhat Σgy·xhat/m).

The forward is optional for the gradients (as in MPS): on a state only the statistics ran
into, the two gradient kernels use the geometry, epsilon, fused neuron and gamma/beta of the
state's `BatchNormalization` (what its forward would have recorded).

The sums are decided when the work runs (`AccumulatorState`): sub-batches accumulate in any
order and any commit order; each statistics run also writes the variance of the sums so far
(readers only read it). The state's fields are stable storage written in place
(`mpsnn.cnn.normalization.batch_norm_state`): read at encode time, client work encoded after
the kernels reads this batch's values. Without statistics in the state (or
without a state) the forward runs in inference mode on the data source's running mean and
variance, which the data source updates from the state (`TensorBatchNormalizationDataSource`).
The state is the third positional argument of every encode, as in MPS's selectors.

On CUDA, float32/float16/bfloat16 NCHW images with no neuron or a ReLU take Triton kernels:
one pass for the statistics, one for normalize + ReLU, one for the gradient sums (the ReLU mask
recomputed from ``x``), one for ``dx``.

The state is in `mpsnn.cnn.normalization.batch_norm_state`, the forward side (statistics,
forward kernel, `read_normalization_vectors`) in
`mpsnn.cnn.normalization.batch_norm_forward`, the gradient kernels in
`mpsnn.cnn.normalization.batch_norm_gradient`.
"""

from mpsnn.cnn.normalization.batch_norm_forward import BatchNormalization as BatchNormalization
from mpsnn.cnn.normalization.batch_norm_forward import (
    BatchNormalizationStatistics as BatchNormalizationStatistics,
)
from mpsnn.cnn.normalization.batch_norm_gradient import (
    BatchNormalizationGradient as BatchNormalizationGradient,
)
from mpsnn.cnn.normalization.batch_norm_gradient import (
    BatchNormalizationStatisticsGradient as BatchNormalizationStatisticsGradient,
)
from mpsnn.cnn.normalization.batch_norm_state import (
    BatchNormalizationState as BatchNormalizationState,
)
from mpsnn.cnn.normalization.data_sources import (
    BatchNormalizationDataSource as BatchNormalizationDataSource,
)
from mpsnn.cnn.normalization.data_sources import (
    GroupNormalizationDataSource as GroupNormalizationDataSource,
)
from mpsnn.cnn.normalization.data_sources import (
    InstanceNormalizationDataSource as InstanceNormalizationDataSource,
)
from mpsnn.cnn.normalization.data_sources import (
    TensorBatchNormalizationDataSource as TensorBatchNormalizationDataSource,
)
from mpsnn.cnn.normalization.data_sources import (
    TensorGroupNormalizationDataSource as TensorGroupNormalizationDataSource,
)
from mpsnn.cnn.normalization.data_sources import (
    TensorInstanceNormalizationDataSource as TensorInstanceNormalizationDataSource,
)
from mpsnn.cnn.normalization.group_norm import GroupNormalization as GroupNormalization
from mpsnn.cnn.normalization.group_norm import (
    GroupNormalizationGradient as GroupNormalizationGradient,
)
from mpsnn.cnn.normalization.group_norm import (
    GroupNormalizationGradientState as GroupNormalizationGradientState,
)
from mpsnn.cnn.normalization.group_norm import InstanceNormalization as InstanceNormalization
from mpsnn.cnn.normalization.group_norm import (
    InstanceNormalizationGradient as InstanceNormalizationGradient,
)
from mpsnn.cnn.normalization.group_norm import (
    InstanceNormalizationGradientState as InstanceNormalizationGradientState,
)
from mpsnn.cnn.normalization.states import (
    NormalizationGammaAndBetaState as NormalizationGammaAndBetaState,
)
from mpsnn.cnn.normalization.states import (
    NormalizationMeanAndVarianceState as NormalizationMeanAndVarianceState,
)

__all__ = [
    "BatchNormalization",
    "BatchNormalizationDataSource",
    "BatchNormalizationGradient",
    "BatchNormalizationState",
    "BatchNormalizationStatistics",
    "BatchNormalizationStatisticsGradient",
    "GroupNormalization",
    "GroupNormalizationDataSource",
    "GroupNormalizationGradient",
    "GroupNormalizationGradientState",
    "InstanceNormalization",
    "InstanceNormalizationDataSource",
    "InstanceNormalizationGradient",
    "InstanceNormalizationGradientState",
    "NormalizationGammaAndBetaState",
    "NormalizationMeanAndVarianceState",
    "TensorBatchNormalizationDataSource",
    "TensorGroupNormalizationDataSource",
    "TensorInstanceNormalizationDataSource",
]
