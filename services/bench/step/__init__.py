"""`shinkai bench step`: whole engine steps against the hardware floor, a PyTorch reference and the previous JSON."""
