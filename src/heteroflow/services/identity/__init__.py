"""Who a caller is and what it may touch: users' JWTs, login, passwords, access, the audit log."""
