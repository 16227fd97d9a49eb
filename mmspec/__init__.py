"""mmspec: fast autoregressive multimodal generation with one speculative draft/verify core."""

from .api import GenerateOutput, generate
from .core.sampling import SamplingConfig
from .core.stats import SpecStats
from .modeling.fast_linear import optimize
from .pipelines import pipeline

__version__ = "0.1.0"
__all__ = ["GenerateOutput", "SamplingConfig", "SpecStats", "generate", "optimize", "pipeline", "__version__"]
