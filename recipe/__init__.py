"""The image-classification recipe: everything image-specific lives here and in conf/."""
