"""A Composer-style Trainer built on Fabric."""
