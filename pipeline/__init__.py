"""liverl: every agent interaction is an event; rewards, samples and weights follow on Kafka."""

from pipeline.settings import Settings, load_settings

__version__ = "0.1.0"

__all__ = ["Settings", "__version__", "load_settings"]
