__version__ = "0.2.0"  # 0.2.0: repository format 3 (encrypted vaults authenticate their settings)
