"""How fast things run: layer-time profiles (measured, imported or roofline estimates), the network
model, and the calibration of the simulator's per-GPU constants."""
