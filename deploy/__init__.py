"""pdserve deploy package."""
