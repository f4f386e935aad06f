"""The LLM-native length predictor (paper §4, docs/design.md §6).

``model`` (the MLP and its checkpoint), ``dataset`` (safetensors shards +
index), ``collect`` (rows from a real engine through the hidden-state tap in
``workers/tap.py``), ``train`` (split, L1/AdamW, early stopping, grid search)
``evaluate`` (MAE/NMAE/Kendall tau by bucket, baselines, plot; its buckets in
``buckets``) and ``live`` (the served R-hat scored against how requests
ended, for the scheduler's /metrics and offline replay). The CLI is
``star predictor``; see ``docs/predictor.md``.
"""
