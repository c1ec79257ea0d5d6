"""Training methods (MixUp, EMA, BlurPool, ...) as Algorithms, each with a plain-function form."""
