"""Training parts the lessons share: data, models, the one loop, timing, the benchmark step split."""
