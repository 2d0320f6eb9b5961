"""Training-framework callbacks that ship checkpoints with ``Vault.backup_async``.

Each is an optional extra with its own import: ``ckptvault.integrations.hf`` needs
``transformers`` (``pip install ckptvault[hf]``), ``ckptvault.integrations.lightning`` needs
``pytorch-lightning`` (``pip install ckptvault[lightning]``) or the unified ``lightning`` package.
Importing this package imports neither.
"""
