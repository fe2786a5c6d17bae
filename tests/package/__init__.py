"""The packages as a whole: import structure and packaging."""
