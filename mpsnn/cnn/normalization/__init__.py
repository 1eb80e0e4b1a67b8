"""The normalization family: batch normalization (statistics over sub-batches, fused
neurons), instance and group normalization, their data sources and parameter states."""

from mpsnn.cnn.normalization.batch_norm import BatchNormalization as BatchNormalization
from mpsnn.cnn.normalization.batch_norm import (
    BatchNormalizationGradient as BatchNormalizationGradient,
)
from mpsnn.cnn.normalization.batch_norm import BatchNormalizationState as BatchNormalizationState
from mpsnn.cnn.normalization.batch_norm import (
    BatchNormalizationStatistics as BatchNormalizationStatistics,
)
from mpsnn.cnn.normalization.batch_norm import (
    BatchNormalizationStatisticsGradient as BatchNormalizationStatisticsGradient,
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
