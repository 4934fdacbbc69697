"""Real inference engines in their own virtual environments, for tests that
check hicached against the engines' own code."""
