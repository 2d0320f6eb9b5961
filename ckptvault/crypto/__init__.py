"""Client-side encryption: keys, the AES-256-GCM sealer, and passphrase-protected keyfiles."""
