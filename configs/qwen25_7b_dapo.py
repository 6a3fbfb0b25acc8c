"""Paper run: qwen25_7b dapo (docs/authors.md §4.1). Needs --config.model.path and
--config.data.train pointing at local files.

The 7B runs train on the authors' difficulty-filtered set (docs/authors.md §7.3, ~15.35K rows;
`train.steps` is sized for it). Make it once from the released Open-AgentRL-30K parquet:

    python -m cleaner_jax.data.filter --input /data/Open-AgentRL-30K.parquet
    # writes /data/Open-AgentRL-30K.filtered_sr.parquet (+ .provenance.json)

then pass `--config.data.train=/data/Open-AgentRL-30K.filtered_sr.parquet`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _paper import paper_config  # noqa: E402

FILTERED_TRAIN = "Open-AgentRL-30K.filtered_sr.parquet"  # cleaner_jax.data.filter's default output name


def get_config():
    c = paper_config(model="qwen25_7b", cleaner=False)
    c.data.train = FILTERED_TRAIN
    return c
