"""Pure tensor math of each family (forward and gradients), with no MPS objects."""
