"""The benchmarks' own SQL: their bulk loaders, clean-ups, table sizes and scratch
databases, on the product's schema and Store."""
