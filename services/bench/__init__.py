"""`shinkai bench`: benchmarks that report measured figures and ratios taken in the same run."""
