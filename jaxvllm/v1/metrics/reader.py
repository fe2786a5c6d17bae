"""`from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector`, as vLLM's metrics
example imports them: jaxvllm's (`jaxvllm.metrics`)."""

from jaxvllm.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
