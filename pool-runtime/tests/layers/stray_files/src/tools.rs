// Not a layer.
