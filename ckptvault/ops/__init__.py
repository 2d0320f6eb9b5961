"""Operations: backup, restore and statistics, orchestrated over a Repository."""
