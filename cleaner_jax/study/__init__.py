"""Seeded studies: arms x seeds of ordinary train runs, resumable, with a summary over seeds
(`python -m cleaner_jax.study --config configs/toy_study.py`, docs/study.md)."""
