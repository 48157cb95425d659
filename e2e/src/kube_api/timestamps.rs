//! Kubernetes' two timestamp formats: `Time` (RFC 3339 in UTC to the second, as in
//! `metadata.creationTimestamp`) and `MicroTime` (exactly six fractional digits, as in a
//! Lease's `spec.renewTime`). The server writes the first and checks the second as the
//! real one decodes it.

use std::time::{SystemTime, UNIX_EPOCH};

/// The layout Go's `metav1.MicroTime` parses with (`RFC3339Micro`).
pub const MICRO_LAYOUT: &str = "2006-01-02T15:04:05.000000Z07:00";

/// RFC 3339 in UTC with second precision, as Kubernetes writes timestamps
/// (`2026-12-01T09:30:00Z`).
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_utc(secs as i64, "")
}

/// A `MicroTime` as the real server decodes and stores it: `YYYY-MM-DDTHH:MM:SS.ffffff`
/// then `Z` or an offset `±HH:MM`; an offset is stored converted to UTC (the server
/// re-encodes in UTC), `Z` as given. The error reads as Go's parse error.
pub fn micro_time(text: &str) -> Result<String, String> {
    let err = |rest: &str, expected: &str| {
        format!("parsing time {text:?} as {MICRO_LAYOUT:?}: cannot parse {rest:?} as {expected:?}")
    };
    let b = text.as_bytes();
    let digits = |from: usize, n: usize| -> Option<i64> {
        let s = text.get(from..from + n)?;
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())
            .flatten()
    };
    // Each field: its offset, width, the layout element it comes from and its range.
    let fields = [
        (0, 4, "2006", 0, 9999),
        (5, 2, "01", 1, 12),
        (8, 2, "02", 1, 31),
        (11, 2, "15", 0, 23),
        (14, 2, "04", 0, 59),
        (17, 2, "05", 0, 59),
    ];
    let mut v = [0i64; 6];
    for (i, (at, width, element, low, high)) in fields.into_iter().enumerate() {
        if at > 0 {
            let sep = [b'-', b'-', b'-', b'T', b':', b':'][i];
            if b.get(at - 1) != Some(&sep) {
                return Err(err(
                    text.get(at - 1..).unwrap_or(""),
                    &MICRO_LAYOUT[at - 1..at],
                ));
            }
        }
        v[i] = digits(at, width).ok_or_else(|| err(text.get(at..).unwrap_or(""), element))?;
        if v[i] < low || v[i] > high {
            return Err(format!(
                "parsing time {text:?}: {} out of range",
                ["year", "month", "day", "hour", "minute", "second"][i]
            ));
        }
    }
    let [year, month, day, hour, minute, second] = v;
    if day > days_in_month(year, month) {
        return Err(format!("parsing time {text:?}: day out of range"));
    }
    let rest = &text[19..];
    let fraction = rest
        .strip_prefix('.')
        .and_then(|r| r.get(..6))
        .filter(|f| f.bytes().all(|c| c.is_ascii_digit()));
    let Some(fraction) = fraction else {
        return Err(err(rest, ".000000"));
    };
    let zone = &rest[7..];
    let offset = match zone.as_bytes() {
        [b'Z'] => return Ok(text.to_owned()),
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2]
            if [h1, h2, m1, m2].iter().all(|c| c.is_ascii_digit()) =>
        {
            let minutes = i64::from((h1 - b'0') * 10 + (h2 - b'0')) * 60
                + i64::from((m1 - b'0') * 10 + (m2 - b'0'));
            if *sign == b'+' { minutes } else { -minutes }
        }
        _ => return Err(err(zone, "Z07:00")),
    };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second
        - offset * 60;
    Ok(format_utc(secs, fraction))
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction]Z` for seconds since the epoch.
fn format_utc(secs: i64, fraction: &str) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    let dot = if fraction.is_empty() { "" } else { "." };
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}{dot}{fraction}Z",
        rem / 3_600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The civil date of a day count from 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times() {
        let at = |secs| rfc3339(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_798_761_599), "2026-12-31T23:59:59Z");
        for days in [-800_000, -1, 0, 11_016, 20_818, 2_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
    }

    fn check(input: &str, expected: Result<&str, &str>) {
        assert_eq!(
            micro_time(input),
            expected.map(str::to_owned).map_err(str::to_owned),
            "{input}"
        );
    }

    #[test]
    fn micro_times() {
        check(
            "2026-11-30T23:59:59.123456Z",
            Ok("2026-11-30T23:59:59.123456Z"),
        );
        check(
            "2026-12-01T01:29:59.000001+01:30",
            Ok("2026-11-30T23:59:59.000001Z"),
        );
        check(
            "2026-12-31T23:00:00.500000-01:00",
            Ok("2027-01-01T00:00:00.500000Z"),
        );
        check(
            "2024-02-29T00:00:00.000000Z",
            Ok("2024-02-29T00:00:00.000000Z"),
        );
        check(
            "2026-11-30T23:59:59Z",
            Err(
                r#"parsing time "2026-11-30T23:59:59Z" as "2006-01-02T15:04:05.000000Z07:00": cannot parse "Z" as ".000000""#,
            ),
        );
        check(
            "2026-11-30T23:59:59.123Z",
            Err(
                r#"parsing time "2026-11-30T23:59:59.123Z" as "2006-01-02T15:04:05.000000Z07:00": cannot parse ".123Z" as ".000000""#,
            ),
        );
        check(
            "2026-11-30T23:59:59.1234567Z",
            Err(
                r#"parsing time "2026-11-30T23:59:59.1234567Z" as "2006-01-02T15:04:05.000000Z07:00": cannot parse "7Z" as "Z07:00""#,
            ),
        );
        check(
            "2026-11-30 23:59:59.123456Z",
            Err(
                r#"parsing time "2026-11-30 23:59:59.123456Z" as "2006-01-02T15:04:05.000000Z07:00": cannot parse " 23:59:59.123456Z" as "T""#,
            ),
        );
        check(
            "2026-13-01T00:00:00.000000Z",
            Err(r#"parsing time "2026-13-01T00:00:00.000000Z": month out of range"#),
        );
        check(
            "2025-02-29T00:00:00.000000Z",
            Err(r#"parsing time "2025-02-29T00:00:00.000000Z": day out of range"#),
        );
        check(
            "yesterday",
            Err(
                r#"parsing time "yesterday" as "2006-01-02T15:04:05.000000Z07:00": cannot parse "yesterday" as "2006""#,
            ),
        );
    }
}
