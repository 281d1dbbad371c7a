"""Drafter training on the target's own features (see ``treespec.train.data`` and ``.loop``)."""
