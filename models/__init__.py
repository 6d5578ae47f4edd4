"""Model families built from tpzoo parallel layers (installed as tpzoo.models)."""
