"""The benchmarks of schedctl (`schedctl bench ...`), a distribution of their own
(schedctl-bench, never in the product's wheel): measured, never asserted."""
