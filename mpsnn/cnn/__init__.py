"""The MPS kernel classes, one subpackage or module per family."""
