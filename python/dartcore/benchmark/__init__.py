"""The decoding benchmark behind ``dart-bench``: datasets, methods (ours and the
Hugging Face baselines), the run loop, the report (JSON + markdown) and plots."""
